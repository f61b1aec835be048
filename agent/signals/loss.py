"""The loss: each rank's value of the step, its non-finite flag, and whether it was known.

Packed without a host sync: a tensor loss rides the SUM vector on its device, a float the host
part. The report's loss is the mean over the ranks that knew theirs (NaN when none did: the
step measured gradients only, which no rule takes for a non-finite loss).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..detect.observed import Observed
from ..measure.reduce import Packer, Reduced, Slot
from ..measure.stats import local
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup

F64 = torch.float64


@dataclasses.dataclass(frozen=True)
class LossSlots:
    """The same layout on every rank, whichever kind of loss each one had (a tensor, a float,
    none: a pipeline's earlier stages), since every rank's vector is summed slot by slot."""

    device: Slot
    """(value, non-finite flag) of a tensor loss; zeros otherwise."""
    host: Slot
    """(value, non-finite flag, known) of a float loss; (0, 0, 1) for a tensor loss."""
    local: Slot


class Loss(Signal):
    rules = ("NonFinite", "LossSpike", "DeadPipeline", "GeneralizationGap")
    metrics = ("torchvitals_loss", "torchvitals_local_loss", "torchvitals_nonfinite_steps_total")
    fills = ("loss", "nonfinite_loss", "local_loss")

    def __init__(self) -> None:
        self._zeros: dict[torch.device, torch.Tensor] = {}

    def pack(self, ctx: StepContext, packer: Packer) -> LossSlots:
        loss = ctx.loss
        if isinstance(loss, torch.Tensor):
            value = local(loss.detach()).reshape(()).to(F64).to(ctx.device)
            return LossSlots(
                packer.add_sum(torch.stack([value, (~torch.isfinite(value)).to(F64)])),
                packer.add_host_sum([0.0, 0.0, 1.0]),
                packer.add_local(value),
            )
        known = loss is not None
        number = float(loss) if loss is not None else 0.0
        zeros = self._zeros.get(ctx.device)
        if zeros is None:
            zeros = self._zeros[ctx.device] = torch.zeros(2, dtype=F64, device=ctx.device)
        return LossSlots(
            packer.add_sum(zeros),
            packer.add_host_sum(
                [number, 0.0 if math.isfinite(number) else 1.0, 1.0 if known else 0.0]
            ),
            packer.add_local(
                torch.full((1,), number if known else math.nan, dtype=F64, device=ctx.device)
            ),
        )

    def unpack(
        self, ctx: StepContext, handle: LossSlots, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        value, flagged = reduced[handle.device]
        number, flagged_host, known = reduced[handle.host]  # known: ranks that knew theirs
        total = value + number
        report.loss = total / known if known else math.nan
        report.nonfinite_loss = flagged + flagged_host > 0 or not math.isfinite(total)
        report.local.loss = reduced.scalar(handle.local)


def build(setup: Setup) -> Loss:
    return Loss()
