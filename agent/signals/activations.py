"""Activation statistics and attention entropy per block, on sampled steps.

Forward hooks armed before a sampled step record 0-d device tensors (no host sync); the step
packs the counts and sums into the SUM vector and the maxima into the MAX vector.

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


class ActivationSignal(Signal):
    rules = ("Activations", "AttentionSaturation")
    fills = ("activations",)
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
    ) -> None:
        """Args:
        acts, attn: the hooks' statistics.
        names: the block names.
        copies: how to learn, once, which ranks hold copies of each block's activations
            (None: every rank sees its own data).
        """
        self.acts, self.attn, self.names = acts, attn, names
        self._copies = copies
        self._weights: tuple[list[float], torch.Tensor] | None = None

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
        attn_counts, neg_entropy, logit = self.attn.take(ctx.device)
        return ActivationSlots(
            packer.add_host_sum(host_counts),
            packer.add_sum(sums),
            packer.add_max(maxes),
            packer.add_host_sum(attn_counts),
            packer.add_max(neg_entropy),
            packer.add_max(logit),
        )

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
    return ActivationSignal(
        ActivationStats(blocks.output_modules, setup.config.saturation_level),
        AttentionStats(unwrap(setup.model), blocks),
        blocks.names,
        copies,
    )
