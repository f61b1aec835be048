"""Checkpoint settlement: a background write commits only once every rank's write ended.

Each rank adds ``[done, failed]`` of its background write to the SUM; when the sums say every
rank finished, every rank commits the checkpoint (ledger, rollback target) in the same step, or
reports that it failed (``recover/staged.py``).
"""

from __future__ import annotations

from ..detect.observed import Observed
from ..measure.reduce import Packer, Reduced, Slot
from ..recover.watchdog import Watchdog
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup


class CheckpointSettlement(Signal):
    metrics = (
        "torchvitals_checkpoint_seconds",
        "torchvitals_checkpoint_failures_total",
        "torchvitals_last_healthy_step",
    )
    fills = ("checkpoint.committed", "checkpoint.failed")

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def pack(self, ctx: StepContext, packer: Packer) -> Slot:
        return packer.add_host_sum(self.watchdog.save_flags())

    def unpack(
        self, ctx: StepContext, handle: Slot, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        self.watchdog.settle(reduced[handle], ctx.world_size, report)


def build(setup: Setup) -> CheckpointSettlement | None:
    """With a watchdog (``checkpoint_dir``) only."""
    return CheckpointSettlement(setup.watchdog) if setup.watchdog is not None else None
