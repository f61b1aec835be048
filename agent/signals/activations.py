"""Activation statistics and attention entropy per block, on sampled steps.

Forward hooks armed before a sampled step record 0-d device tensors (no host sync); the step
packs the counts and sums into the SUM vector and the maxima into the MAX vector.
"""

from __future__ import annotations

import dataclasses
import math

from ..detect.observed import Observed
from ..measure.activations import ActivationStats, summarize
from ..measure.attention import AttentionStats
from ..measure.blocks import unwrap
from ..measure.reduce import Packer, Reduced, Slot
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup


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

    def __init__(self, acts: ActivationStats, attn: AttentionStats, names: list[str]) -> None:
        self.acts, self.attn, self.names = acts, attn, names

    def arm(self) -> None:
        """Record the next step's training forward passes."""
        self.acts.arm()
        self.attn.arm()

    def pack(self, ctx: StepContext, packer: Packer) -> ActivationSlots | None:
        if not self.acts.armed:
            return None
        counts, sums, maxes = self.acts.take(ctx.device)
        attn_counts, neg_entropy, logit = self.attn.take(ctx.device)
        return ActivationSlots(
            packer.add_host_sum(counts),
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
    return ActivationSignal(
        ActivationStats(blocks.output_modules, setup.config.saturation_level),
        AttentionStats(unwrap(setup.model), blocks),
        blocks.names,
    )
