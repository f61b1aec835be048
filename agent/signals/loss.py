"""The loss: each rank's value of the step, its non-finite flag, and whether it was known.

Packed without a host sync: a tensor loss rides the SUM vector on its device, a float the host
part. The report's loss is the mean over the ranks that knew theirs (NaN when none did: the
step measured gradients only, which no rule takes for a non-finite loss).

The non-finite flag rides as ``[f, rank·f, rank²·f]`` (``measure/ranksum.py``), so every rank
learns which rank's loss was NaN or Inf, one or two exactly, more counted, in the same SUM at
any world size: two more floats on each side, no collective, no sync (on the device the flag is
multiplied by a cached ``[1, rank, rank²]``).

The spike's culprit rides the same way: a rank flags itself when its own loss alone could have
lifted the mean past the loss rule's threshold, i.e. lies at least ``n`` times as far above the
median as the threshold does (``n`` the ranks that knew their loss at the previous step). The
median and threshold are the rule's of the previous step (``Detector.loss_level``), identical on
every rank, so the comparison is one more kernel against a host float: no sync. A spike every
rank shares (a learning rate too hot) flags no rank; one rank's bad shard or bad forward flags
that rank, and the ``loss_outlier``/``loss_spike`` verdict names it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ..detect.observed import Observed
from ..measure import ranksum
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
    """(value, flag, rank·flag, rank²·flag, out, rank·out, rank²·out) of a tensor loss (flag:
    non-finite; out: far past the spike level); zeros otherwise."""
    host: Slot
    """(value, known, flag, rank·flag, rank²·flag, out, rank·out, rank²·out) of a float loss;
    (0, 1, 0, ...) for a tensor loss."""
    local: Slot


class Loss(Signal):
    rules = ("NonFinite", "LossSpike", "GradSpike", "DeadPipeline", "GeneralizationGap")
    metrics = ("torchvitals_loss", "torchvitals_local_loss", "torchvitals_nonfinite_steps_total")
    fills = (
        "loss",
        "nonfinite_loss",
        "nonfinite_ranks",
        "nonfinite_rank_count",
        "spike_ranks",
        "spike_rank_count",
        "local.loss",
    )

    def __init__(self, level: Callable[[], tuple[float, float] | None] = lambda: None) -> None:
        self._level = level
        self._knew = 1
        """Ranks that knew their loss at the last step (the mean's divisor)."""
        self._zeros: dict[torch.device, torch.Tensor] = {}
        self._powers: dict[torch.device, torch.Tensor] = {}

    def _cut(self) -> float:
        """A loss above this lifts the mean past the threshold alone (inf: nothing judged yet)."""
        level = self._level()
        if level is None:
            return math.inf
        median, threshold = level
        return median + self._knew * (threshold - median)

    def pack(self, ctx: StepContext, packer: Packer) -> LossSlots:
        loss = ctx.loss
        cut = self._cut()
        if isinstance(loss, torch.Tensor):
            value = local(loss.detach()).reshape(()).to(F64).to(ctx.device)
            powers = self._powers.get(ctx.device)
            if powers is None:
                powers = self._powers[ctx.device] = torch.tensor(
                    ranksum.powers(ctx.rank), dtype=F64, device=ctx.device
                )
            flags = (~torch.isfinite(value)).to(F64) * powers
            out = (value > cut).to(F64) * powers  # a NaN compares False: it has its own flag
            return LossSlots(
                packer.add_sum(torch.cat([value.reshape(1), flags, out])),
                packer.add_host_sum([0.0, 1.0] + [0.0] * (2 * ranksum.SLOTS)),
                packer.add_local(value),
            )
        known = loss is not None
        number = float(loss) if loss is not None else 0.0
        zeros = self._zeros.get(ctx.device)
        if zeros is None:
            zeros = self._zeros[ctx.device] = torch.zeros(
                1 + 2 * ranksum.SLOTS, dtype=F64, device=ctx.device
            )
        flag = 0.0 if math.isfinite(number) else 1.0
        far = 1.0 if known and number > cut else 0.0
        return LossSlots(
            packer.add_sum(zeros),
            packer.add_host_sum(
                [
                    number,
                    1.0 if known else 0.0,
                    *ranksum.encode(ctx.rank, flag),
                    *ranksum.encode(ctx.rank, far),
                ]
            ),
            packer.add_local(
                torch.full((1,), number if known else math.nan, dtype=F64, device=ctx.device)
            ),
        )

    def unpack(
        self, ctx: StepContext, handle: LossSlots, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        value, *flags = reduced[handle.device]
        number, known, *host_flags = reduced[handle.host]  # known: ranks that knew theirs
        total = value + number
        report.loss = total / known if known else math.nan
        summed = [a + b for a, b in zip(flags, host_flags)]
        n = ranksum.SLOTS
        count, ranks = ranksum.decode(*summed[:n])
        report.nonfinite_loss = count > 0 or not math.isfinite(total)
        report.nonfinite_rank_count, report.nonfinite_ranks = count, ranks
        report.spike_rank_count, report.spike_ranks = ranksum.decode(*summed[n:])
        report.local.loss = reduced.scalar(handle.local)
        self._knew = max(1, round(known))


def build(setup: Setup) -> Loss:
    return Loss(setup.loss_level)
