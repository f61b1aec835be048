"""Detection thresholds: every number a rule compares against, with where its default comes from.

    watch(model, optimizer, detect={"loss_spike_mads": 8})
    TORCHVITALS_DETECT='{"loss_spike_mads": 8}' python train.py

A leaf: plain numbers, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, ConfigTypeError
from ...settings import check_types


@dataclass(kw_only=True)
class Thresholds:
    """Detection thresholds (``watch(..., detect={...})`` or ``TORCHVITALS_DETECT='{...}'``).

    Defaults come from the scenarios in tests/scenarios: each fires on its reproduced failure
    and none fires on healthy runs of the small transformer over 3 seeds x 300 steps.
    """

    warmup_steps: int = 10
    """Steps excluded from the rolling baselines (the first steps move fast by nature)."""
    window: int = 50
    """Length of the rolling windows (steps for per-step signals, samples for sampled ones)."""
    min_history: int = 8
    """Values a rolling baseline needs before a rule judges against it."""
    loss_spike_mads: float = 6.0
    """A loss above median + this x scale is a spike (scale: 1.4826 x the MAD of the step-to-step
    differences / sqrt(2), floored below)."""
    loss_spike_floor: float = 0.02
    """The spike scale is at least this fraction of the median loss, so a flat series does not
    alarm on noise (with ``loss_spike_mads`` 6: a loss at least 12% above its median; 0.05 until
    the real-curve backtest, where it hid 10-40% spikes of smooth large-batch losses)."""
    loss_spike_abs_floor: float = 1e-3
    """... and at least this fraction of the first step's loss, so a loss memorised down to 1e-7
    does not page on every wiggle."""
    loss_spike_recent: int = 3
    """A loss past the threshold is a spike (a page) once ``loss_spike_recent_hits`` of the last
    this many steps were past it (one noisy batch past it, back at once, is at most an outlier:
    seen once in 40 healthy runs at the tail of a cosine schedule, and once in every few hundred
    steps of the noisiest real per-batch losses; a rising spike may dip once on its way up) ..."""
    loss_spike_recent_hits: int = 2
    """... (this many) ..."""
    loss_spike_severe: float = 1.0
    """A single step past the threshold, at least this many times as far above the median as
    the threshold (1: any), is a ``loss_outlier``: a warning, since the next batch may heal it
    (one bad batch); the page (``loss_spike``) waits for ``loss_spike_recent_hits``. (2 until the
    real-curve backtest, when such a step paged at once; below 2 nothing was said of it.)"""
    loss_divergence_rise: float = 0.1
    """The rolling median loss this fraction above the lowest it reached ..."""
    loss_divergence_steps: int = 50
    """... on this many consecutive steps is a ``loss_divergence`` (a warning): a rise too slow
    for the spike rule, which takes each step into its median."""
    grad_spike_factor: float = 2.5
    """A total gradient norm at least this many times its rolling median, on a step whose loss
    stayed below the spike threshold, is a ``grad_spike`` (a warning)."""
    explosion_growth: float = 1.5
    """Total grad norm growing by at least this factor per step ..."""
    explosion_steps: int = 3
    """... for this many consecutive steps ..."""
    explosion_factor: float = 5.0
    """... and ending at least this many times its rolling median is a gradient explosion."""
    divergence_factor: float = 4.0
    """A block whose grad norm is this many times its own rolling median ..."""
    divergence_cluster: float = 1.5
    """... while the other blocks' median of the same ratio stays below this, diverges (on two
    consecutive steps: one noisy step of a small head is not a divergence)."""
    healthy_update_ratio: float = 1e-3
    """The update ratio (update norm / weight norm) of a block training well: the evidence's
    reference for ``hot_lr``, not itself a trigger."""
    hot_lr_ratio: float = 1e-2
    """An update ratio at least this (10x the healthy 1e-3) ..."""
    hot_lr_rise: float = 2.0
    """... and this many times the block's earlier median is a hot learning rate."""
    dead_ratio: float = 1e-6
    """An update ratio at or below this, while the other blocks' median is at least
    ``dead_moving_factor`` times larger ..."""
    dead_moving_factor: float = 100.0
    """... (this factor: the others do train) ..."""
    dead_samples: int = 2
    """... on this many consecutive samples is a dead layer."""
    vanishing_ratio: float = 100.0
    """Last-layer over first-layer grad norm at least this ..."""
    vanishing_steps: int = 3
    """... for this many consecutive steps is vanishing gradients."""
    saturation_fraction: float = 0.5
    """Bounded (tanh/sigmoid) outputs with at least this fraction at |x| >= saturation_level."""
    dead_relu_fraction: float = 0.9
    """At least this fraction of a block's outputs exactly zero is dead ReLU."""
    explosion_abs_max: float = 100.0
    """Activation abs max at least this on the first sample ..."""
    explosion_hold: float = 0.5
    """... and not falling below this fraction of it ..."""
    explosion_samples: int = 3
    """... for this many samples is activation explosion (once it fell below, the block is not
    judged again)."""
    activation_culprit_factor: float = 8.0
    """On a sampled step, a rank whose own output RMS of a block is at least this many times the
    block's RMS over every rank at the last sample names itself (the culprit of a spike its loss
    does not name). A healthy 2-rank run's ranks stay within 1.21x of the last sample's RMS, a
    learning rate 20x too hot grows every rank's about 2x between samples (shared: no rank is
    named); a fault deep in one rank's forward is 1000x."""
    attention_entropy: float = 0.1
    """Minimum per-head attention entropy (nats) at or below this is attention saturation ..."""
    attention_logit: float = 1e3
    """... as is a max attention logit at or above this."""
    overflow_skips: int = 3
    """This many GradScaler-skipped steps within ``window`` steps is fp16 overflow."""
    dead_pipeline_steps: int = 20
    """Loss flat and gradients ~0 over the first this many steps is a dead pipeline (every
    gradient exactly zero: over the first ``dead_pipeline_zero_steps``) ..."""
    dead_pipeline_zero_steps: int = 3
    """... (this many) ..."""
    dead_pipeline_flat: float = 1e-4
    """... where flat means a loss range within this fraction of its median (plus 1e-8) ..."""
    tiny_grad: float = 1e-8
    """... where ~0 means a total grad norm at or below this."""
    straggler_factor: float = 1.5
    """A rank's compute time at least this x the other ranks' mean ..."""
    straggler_min_seconds: float = 0.05
    """... and at least this many seconds more ..."""
    straggler_steps: int = 5
    """... for this many consecutive steps is a straggler."""
    memory_growth_samples: int = 8
    """Resident (or accelerator) memory rising at every one of this many consecutive samples
    (past warm-up) ... A healthy run's memory plateaus once the optimizer state and the
    allocator's pools exist (flat after step 2 in the scenarios); a leak climbs sample after
    sample."""
    memory_growth_min_bytes: float = 64 * 2**20
    """... by at least this many bytes in all ..."""
    memory_growth_min_ratio: float = 0.02
    """... and by at least this fraction of where it started is memory growth. (64 MiB and 2%:
    well above the few MiB a healthy scenario run's memory moves after warm-up, far below the
    tens of GiB a leak reaches before the kernel's OOM kill.)"""
    data_stall_ratio: float = 0.5
    """The ranks spending at least this share of their step time waiting for data (half the step
    idle; the sleeping-loader scenario waits ~90% of its steps, the healthy one under 1%)
    ..."""
    data_stall_min_seconds: float = 0.01
    """... at least this long per step on average (a toy loop's microseconds are no stall) ..."""
    data_stall_steps: int = 5
    """... for this many consecutive steps past warm-up is a data stall (the first batches,
    while the DataLoader's workers start, are excluded by the warm-up)."""
    replica_mismatch_samples: int = 1
    """Sampled steps in a row on which the DDP replicas' fingerprints differ before the
    critical ``replica_divergence`` (1: the fingerprints are exact integers of bitwise-identical
    replicas, so there is no noise to wait out)."""
    gap_validations: int = 3
    """Validation loss rising over this many reports while the training loss falls ..."""
    gap_min_rise: float = 0.02
    """... by at least this fraction over its best is a generalization gap."""

    @classmethod
    def from_overrides(cls, overrides: Mapping[str, Any] | None) -> Thresholds:
        """The defaults with ``overrides`` (``watch(detect=...)``) on top, each checked.

        Raises:
            ConfigTypeError: an unknown name, or a value of the wrong type (also a TypeError).
            ConfigError: a value out of its range (also a ValueError).
        """
        overrides = dict(overrides or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigTypeError(
                "detect",
                overrides,
                f"unknown detection threshold(s) {sorted(unknown)}; known: {sorted(known)}",
            )
        return cls(**overrides)

    def __post_init__(self) -> None:
        check_types(self, {f.name: f"detect.{f.name}" for f in dataclasses.fields(self)})
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _AT_LEAST_ZERO:
                ok, allowed = value >= 0, "an integer >= 0"
            elif f.type in ("int", int):
                ok, allowed = value >= 1, "an integer >= 1"
            elif f.name in _FRACTIONS:
                ok, allowed = 0 < value <= 1, "a fraction in (0, 1]"
            else:
                ok, allowed = value > 0, "a number > 0"
            if not ok:
                raise ConfigError(f"detect.{f.name}", value, allowed)
        if self.loss_spike_recent_hits > self.loss_spike_recent:
            raise ConfigError(
                "detect.loss_spike_recent_hits",
                self.loss_spike_recent_hits,
                f"at most detect.loss_spike_recent ({self.loss_spike_recent})",
            )


_AT_LEAST_ZERO = {"warmup_steps"}
_FRACTIONS = {
    "saturation_fraction",
    "dead_relu_fraction",
    "data_stall_ratio",
    "loss_spike_floor",
    "explosion_hold",
    "dead_pipeline_flat",
}
