"""The GradScaler (fp16): the scale of the step, and an overflow agreed on by every rank.

When the step goes through an enabled scaler, the step unscales the gradients before any signal
measures them (``measure/scaler.py``), so the norms are the real ones; the scale rides the SUM
(as scale / world, so the sum is the scale). An overflow is a non-finite gradient with a finite
loss, from the reduced flags, so every rank's scaler skips and backs off together.
"""

from __future__ import annotations

from ..detect.observed import Observed
from ..measure.reduce import Packer, Reduced, Slot
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup


class Scaler(Signal):
    """Must come after the loss and gradient signals: it reads their non-finite flags."""

    rules = ("Fp16Overflow", "NonFinite")
    metrics = ("torchvitals_loss_scale", "torchvitals_skipped_steps_total")
    fills = ("loss_scale", "overflow")

    def pack(self, ctx: StepContext, packer: Packer) -> Slot | None:
        if ctx.scale is None:
            return None
        return packer.add_sum(ctx.scale / ctx.world_size)

    def unpack(
        self,
        ctx: StepContext,
        handle: Slot | None,
        reduced: Reduced,
        report: Report,
        seen: Observed,
    ) -> None:
        if handle is None:
            return
        report.loss_scale = reduced.scalar(handle)
        report.overflow = report.nonfinite_grad and not report.nonfinite_loss


def build(setup: Setup) -> Scaler:
    return Scaler()
