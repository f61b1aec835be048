"""Activation statistics and attention entropy per block, on sampled steps.

Forward hooks armed before a sampled step record 0-d device tensors (no host sync); the step
packs the counts and sums into the SUM vector and the maxima into the MAX vector.

Each rank also flags itself when its own output RMS of a block is ``activation_culprit_factor``
times the block's RMS over every rank at the last sample none flagged: ``[f, rank·f, rank²·f]``
in the same SUM (``measure/ranksum.py``), so a spike whose loss names no rank (a ``grad_spike``)
still can. The limits are host floats from the last sample, the comparison one kernel: no
sync. Only where each rank's activations are its own (not with tensor parallelism, whose
copies would flag together).

Where ranks can run the forward pass on the same batch (a layout with DTensor parameters: tensor
parallelism), the first sampled step learns once which ranks hold copies of each block's
activations (``measure.copies``, one all_gather); from then on each copy's counts and sums are
weighted by one over their number, on the device, so a replicated output counts once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import torch

from ..detect.observed import Observed
from ..measure import ranksum
from ..measure.activations import ActivationStats, summarize
from ..measure.attention import AttentionStats
from ..measure.blocks import unwrap
from ..measure.copies import count_copies
from ..measure.reduce import Packer, Reduced, Slot
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup

F64 = torch.float64
CountCopies = Callable[[Sequence[float], torch.Tensor, torch.Tensor], list[float]]
"""(counts, sums, maxes) of this rank -> per block, the ranks holding identical activations."""


@dataclasses.dataclass(frozen=True)
class ActivationSlots:
    count: Slot
    sums: Slot
    abs_max: Slot
    attn_count: Slot
    attn_neg_entropy: Slot
    attn_logit: Slot
    far: Slot | None
    """``[f, rank·f, rank²·f]``: this rank's own activations far out (None: not judged)."""


class ActivationSignal(Signal):
    rules = ("Activations", "AttentionSaturation")
    fills = ("activations", "activation_ranks", "activation_rank_count")
    metrics = (
        "torchvitals_activation_mean",
        "torchvitals_activation_rms",
        "torchvitals_activation_abs_max",
        "torchvitals_activation_zero_ratio",
        "torchvitals_activation_saturated_ratio",
        "torchvitals_activation_nonfinite",
        "torchvitals_attention_entropy_min",
        "torchvitals_attention_logit_max",
    )

    def __init__(
        self,
        acts: ActivationStats,
        attn: AttentionStats,
        names: list[str],
        copies: CountCopies | None = None,
        culprit_factor: float | None = None,
    ) -> None:
        """Args:
        acts, attn: the hooks' statistics.
        names: the block names.
        copies: how to learn, once, which ranks hold copies of each block's activations
            (None: every rank sees its own data).
        culprit_factor: a rank's own block RMS this many times the block's last RMS over the
            ranks flags the rank (None: no rank judged, where activations are not each rank's
            own, or one rank alone).
        """
        self.acts, self.attn, self.names = acts, attn, names
        self._copies = copies
        self._weights: tuple[list[float], torch.Tensor] | None = None
        self._factor = culprit_factor
        self._reference: list[float] | None = None
        """Per block, its RMS over the ranks at the last sample no rank flagged (NaN: unseen)."""
        self._powers: dict[torch.device, torch.Tensor] = {}

    def arm(self) -> None:
        """Record the next step's training forward passes."""
        self.acts.arm()
        self.attn.arm()

    def pack(self, ctx: StepContext, packer: Packer) -> ActivationSlots | None:
        if not self.acts.armed:
            return None
        counts, sums, maxes = self.acts.take(ctx.device)
        if self._copies is not None:
            copies, self._copies = self._copies(counts, sums, maxes), None
            if any(c != 1.0 for c in copies):
                inverse = [1.0 / c for c in copies]
                self._weights = (inverse, torch.tensor(inverse, dtype=F64, device=ctx.device))
        host_counts: list[float] = list(map(float, counts))
        if self._weights is not None:
            inverse, weights = self._weights
            host_counts = [n * w for n, w in zip(host_counts, inverse)]
            sums = sums * weights.unsqueeze(1)
        far = None if self._factor is None else packer.add_sum(self._far(counts, sums, ctx))
        attn_counts, neg_entropy, logit = self.attn.take(ctx.device)
        return ActivationSlots(
            packer.add_host_sum(host_counts),
            packer.add_sum(sums),
            packer.add_max(maxes),
            packer.add_host_sum(attn_counts),
            packer.add_max(neg_entropy),
            packer.add_max(logit),
            far,
        )

    def _far(self, counts: Sequence[float], sums: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[f, rank·f, rank²·f]`` on the device: f = 1 when some block's sum of squares here
        reaches ``count · (factor · reference RMS)²``, its limit (infinite where unjudged)."""
        powers = self._powers.get(ctx.device)
        if powers is None:
            powers = self._powers[ctx.device] = torch.tensor(
                ranksum.powers(ctx.rank), dtype=F64, device=ctx.device
            )
        reference = self._reference or [math.nan] * len(counts)
        factor = self._factor or math.inf
        limits = [
            n * (factor * r) ** 2 if n > 0 and math.isfinite(r) and r > 0 else math.inf
            for n, r in zip(counts, reference)
        ]
        limit = torch.tensor(limits, dtype=F64)
        if ctx.device.type != "cpu":
            # Pinned + non_blocking: a pageable host-to-device copy would wait for the stream.
            limit = limit.pin_memory().to(ctx.device, non_blocking=True)
        return (sums[:, 1] >= limit).any().to(F64) * powers

    def unpack(
        self,
        ctx: StepContext,
        handle: ActivationSlots | None,
        reduced: Reduced,
        report: Report,
        seen: Observed,
    ) -> None:
        if handle is None:
            return
        counts, sums, maxes = reduced[handle.count], reduced[handle.sums], reduced[handle.abs_max]
        report.activations = {
            n: summarize(counts[b], sums[5 * b : 5 * b + 5], maxes[b])
            for b, n in enumerate(self.names)
            if counts[b] > 0
        }
        attn, neg_entropy, logit = (
            reduced[handle.attn_count],
            reduced[handle.attn_neg_entropy],
            reduced[handle.attn_logit],
        )
        if handle.far is not None:
            count, ranks = ranksum.decode(*reduced[handle.far])
            report.activation_rank_count, report.activation_ranks = count, ranks
            if count == 0:  # a clean sample: the next one is judged against it
                self._reference = [
                    report.activations[n]["rms"] if n in report.activations else math.nan
                    for n in self.names
                ]
        for b, n in enumerate(self.names):
            if attn[b] > 0 and n in report.activations:
                report.activations[n]["attention_entropy"] = -neg_entropy[b]
                report.activations[n]["attention_logit_max"] = (
                    logit[b] if logit[b] > -math.inf else math.nan
                )

    def close(self) -> None:
        self.acts.close()
        self.attn.close()


def build(setup: Setup) -> ActivationSignal | None:
    """On unless ``Config.activations`` is off: hooks on each block's output module."""
    if not setup.config.activations:
        return None
    blocks = setup.blocks
    copies = None
    if setup.world_size > 1 and setup.dtensors:
        copies = functools.partial(
            count_copies,
            group=setup.group,
            world=setup.world_size,
            device=setup.collective_device,
        )
    own = setup.world_size > 1 and copies is None  # each rank's activations its own
    return ActivationSignal(
        ActivationStats(blocks.output_modules, setup.config.saturation_level),
        AttentionStats(unwrap(setup.model), blocks),
        blocks.names,
        copies,
        setup.thresholds.activation_culprit_factor if own else None,
    )
