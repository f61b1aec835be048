"""Step and compute times: the ranks' means, and stragglers named without a world-sized payload.

Host floats a step (this rank's step time, and its compute time in its stage's slot: one slot
without pipeline parallelism) give every rank the means; each rank judges itself against the
mean of the others of its stage (a pipeline's stages differ in compute by design) and its flag
rides the next step's SUM (``detect/straggler.py`` explains the encoding). O(1) in the world
size.
"""

from __future__ import annotations

import dataclasses

from ..detect.observed import Observed
from ..detect.straggler import RankTiming
from ..measure.reduce import Packer, Reduced, Slot
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup


@dataclasses.dataclass(frozen=True)
class TimingSlots:
    seconds: Slot
    flags: Slot


class Timing(Signal):
    """Must come after the data-wait signal: a straggler's flag carries its own data wait."""

    rules = ("Straggler",)
    metrics = ("torchvitals_step_duration_seconds", "torchvitals_compute_duration_seconds")
    fills = ("timing.mean_step_seconds", "timing.mean_compute_seconds", "seen.straggler_flags")

    def __init__(self, timing: RankTiming, stage: int = 0, stages: int = 1) -> None:
        self.timing, self.stage, self.stages = timing, stage, stages

    def pack(self, ctx: StepContext, packer: Packer) -> TimingSlots:
        seconds = [ctx.step_seconds] + [0.0] * self.stages
        seconds[1 + self.stage] = ctx.compute_seconds
        return TimingSlots(packer.add_host_sum(seconds), packer.add_host_sum(self.timing.flags()))

    def unpack(
        self,
        ctx: StepContext,
        handle: TimingSlots,
        reduced: Reduced,
        report: Report,
        seen: Observed,
    ) -> None:
        step_sum, *compute_sums = reduced[handle.seconds]
        report.timing.mean_step_seconds = step_sum / ctx.world_size
        report.timing.mean_compute_seconds = sum(compute_sums) / ctx.world_size
        seen.straggler_flags = reduced[handle.flags]
        others_step = (
            (step_sum - ctx.step_seconds) / (ctx.world_size - 1) if ctx.world_size > 1 else 0.0
        )
        self.timing.observe(
            ctx.compute_seconds,
            compute_sums[self.stage],
            report.timing.data_wait_seconds,
            step=(ctx.step_seconds, others_step),
        )


def build(setup: Setup) -> Timing:
    """Each rank is judged among its own pipeline stage's ranks."""
    layout = setup.layout
    timing = RankTiming(setup.thresholds, setup.rank, layout.stage_sizes[layout.stage])
    return Timing(timing, layout.stage, len(layout.stage_sizes))
