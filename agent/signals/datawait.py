"""Data wait: each rank's time waiting for its batches, and the job's share of the step.

Two host floats a step in the SUM (this rank's wait and step time), so every rank knows the
job's data-wait share; a straggler's own wait rides its flag (``signals/timing.py``).
"""

from __future__ import annotations

import dataclasses

from ..detect.observed import Observed
from ..measure.datawait import DataWait
from ..measure.reduce import Packer, Reduced, Slot
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup


@dataclasses.dataclass(frozen=True)
class WaitSlot:
    sums: Slot
    local_wait: float


class DataWaitSignal(Signal):
    rules = ("DataStall",)
    metrics = ("torchvitals_data_wait_seconds", "torchvitals_data_wait_ratio")
    fills = ("timing.data_wait_seconds", "timing.data_wait_mean_seconds", "timing.data_wait_ratio")

    def __init__(self, wait: DataWait) -> None:
        self.wait = wait

    def pack(self, ctx: StepContext, packer: Packer) -> WaitSlot:
        local_wait = self.wait.take()
        return WaitSlot(packer.add_host_sum([local_wait, ctx.step_seconds]), local_wait)

    def unpack(
        self, ctx: StepContext, handle: WaitSlot, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        wait_sum, step_sum = reduced[handle.sums]
        report.timing.data_wait_seconds = handle.local_wait
        report.timing.data_wait_mean_seconds = wait_sum / ctx.world_size
        report.timing.data_wait_ratio = wait_sum / step_sum if step_sum > 0 else 0.0


def build(setup: Setup) -> DataWaitSignal:
    return DataWaitSignal(setup.data_wait)
