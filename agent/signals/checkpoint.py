"""Checkpoint settlement: a background write commits only once every rank's write ended.

Each rank adds ``[done, failed]`` of its background write to the SUM; when the sums say every
rank finished, every rank commits the checkpoint (ledger, rollback target) in the same step, or
reports that it failed (``recover/staged.py``).
"""

from __future__ import annotations

from typing import Any

from ..detect.observed import Observed
from ..measure.reduce import Packer, Reduced, Slot
from ..report import Report
from .base import Signal, StepContext


class CheckpointSettlement(Signal):
    metrics = (
        "torchvitals_checkpoint_seconds",
        "torchvitals_checkpoint_failures_total",
        "torchvitals_last_healthy_step",
    )

    def __init__(self, watchdog: Any) -> None:
        self.watchdog = watchdog

    def pack(self, ctx: StepContext, packer: Packer) -> Slot:
        return packer.add_host_sum(self.watchdog.save_flags())

    def unpack(
        self, ctx: StepContext, handle: Slot, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        self.watchdog.settle(reduced[handle], ctx.world_size, report)
