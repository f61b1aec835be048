"""What the loop did with the step on each rank: skipped it by itself, or stepped twice on the
same gradients. Two flags riding the step's SUM, so every rank acts on them in the same step.

A loop or a framework may skip ``optimizer.step()`` on one rank alone (its own test of a loss it
alone saw, a local overflow check) and clear the gradients: the agent settles that step as a
skip on that rank (``Agent._settle_skipped``). Decided there alone, the other ranks would step
and the replicas' weights part for good; here each rank adds ``[f, r·f, r²·f]`` for its flag
(``measure/ranksum.py``), so every rank skips when any rank did and the report names which. A
second ``optimizer.step()`` on the same gradients (no backward pass since the last step) is
flagged the same way, and every rank raises ``DoubleStepError`` together, naming the rank,
instead of that rank alone leaving the others in the next collective. Six host floats, no sync.
"""

from __future__ import annotations

from ..detect.observed import Observed
from ..measure import ranksum
from ..measure.reduce import Packer, Reduced, Slot
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup


class LoopFlags(Signal):
    fills = ("loop_skip_ranks", "loop_skip_count", "seen.repeated")

    def pack(self, ctx: StepContext, packer: Packer) -> Slot:
        return packer.add_host_sum(
            [
                *ranksum.encode(ctx.rank, 1.0 if ctx.loop_skipped else 0.0),
                *ranksum.encode(ctx.rank, 1.0 if ctx.repeated else 0.0),
            ]
        )

    def unpack(
        self, ctx: StepContext, handle: Slot, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        values = reduced[handle]
        report.loop_skip_count, report.loop_skip_ranks = ranksum.decode(*values[: ranksum.SLOTS])
        seen.repeated = ranksum.decode(*values[ranksum.SLOTS :])


def build(setup: Setup) -> LoopFlags:
    """On every run: whether a rank skips or steps twice is known only when it happens."""
    return LoopFlags()
