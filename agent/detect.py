"""Detection: turn the stream of step reports into named verdicts.

The Detector runs on every rank from the reduced report only (never from ``local_*`` fields),
with the same deterministic code, so every rank reaches the same verdicts in the same step.
A warning is emitted when its (pattern, block) becomes active and stays active, silently, while
its rule keeps seeing it; critical verdicts are emitted every step they hold, since the
watchdog acts on each.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

from .report import Report

INFO, WARNING, CRITICAL = "info", "warning", "critical"
SEVERITIES = (INFO, WARNING, CRITICAL)

PATTERNS = {
    "nonfinite_loss": CRITICAL, "nonfinite_grad": CRITICAL, "loss_spike": CRITICAL,
    "grad_explosion": WARNING, "layer_divergence": WARNING, "hot_lr": WARNING,
    "dead_layer": WARNING, "vanishing_gradients": WARNING, "saturation": WARNING,
    "dead_relu": WARNING, "activation_explosion": WARNING, "attention_saturation": WARNING,
    "fp16_overflow": WARNING, "dead_pipeline": WARNING, "generalization_gap": WARNING,
    "straggler": WARNING, "rollback_loop": CRITICAL, "collector_directive": CRITICAL,
}
"""Every pattern the detector can name, with its severity (bounded label set for metrics)."""


@dataclass(frozen=True)
class Verdict:
    """A named failure pattern, where it starts, how sure, and the numbers behind it."""

    pattern: str
    severity: str
    step: int
    block: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    """The values, the threshold that fired (by its Thresholds name) and the window."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = f" in {self.block}" if self.block else ""
        return f"[{self.severity}] step {self.step}: {self.pattern}{where}"


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
    """A loss above median + this x scale is a spike (scale: 1.4826 x MAD, floored below)."""
    loss_spike_floor: float = 0.05
    """The spike scale is at least this fraction of the median loss, so a flat series does not
    alarm on noise."""
    loss_spike_abs_floor: float = 1e-3
    """... and at least this fraction of the first step's loss, so a loss memorised down to 1e-7
    does not page on every wiggle."""
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
    hot_lr_ratio: float = 1e-2
    """An update ratio at least this (10x the healthy 1e-3) ..."""
    hot_lr_rise: float = 2.0
    """... and this many times the block's earlier median is a hot learning rate."""
    dead_ratio: float = 1e-6
    """An update ratio at or below this, while the other blocks' median is 100x larger ..."""
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
    explosion_samples: int = 3
    """... and not falling below half of it for this many samples is activation explosion."""
    attention_entropy: float = 0.1
    """Minimum per-head attention entropy (nats) at or below this is attention saturation ..."""
    attention_logit: float = 1e3
    """... as is a max attention logit at or above this."""
    overflow_skips: int = 3
    """This many GradScaler-skipped steps within ``window`` steps is fp16 overflow."""
    dead_pipeline_steps: int = 20
    """Loss flat and gradients ~0 over the first this many steps is a dead pipeline ..."""
    tiny_grad: float = 1e-8
    """... where ~0 means a total grad norm at or below this."""
    straggler_factor: float = 1.5
    """A rank's compute time at least this x the other ranks' median ..."""
    straggler_min_seconds: float = 0.05
    """... and at least this many seconds more ..."""
    straggler_steps: int = 5
    """... for this many consecutive steps is a straggler."""
    gap_validations: int = 3
    """Validation loss rising over this many reports while the training loss falls ..."""
    gap_min_rise: float = 0.02
    """... by at least this fraction over its best is a generalization gap."""

    @classmethod
    def from_overrides(cls, overrides: Mapping[str, Any] | None) -> "Thresholds":
        overrides = dict(overrides or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown detection threshold(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**overrides)


def _key(v: Verdict) -> tuple[str, str | None, Any]:
    return (v.pattern, v.block, v.evidence.get("rank"))


def median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return math.nan
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def mad(values: Iterable[float], center: float) -> float:
    """Median absolute deviation around ``center``."""
    return median(abs(v - center) for v in values)


class Detector:
    """Runs the pattern rules over each report; keeps the active set and the history."""

    def __init__(self, block_names: list[str], block_kinds: list[str],
                 thresholds: Thresholds | None = None, static: list[Verdict] | None = None):
        from .patterns import make_rules
        self.thresholds = thresholds or Thresholds()
        self.block_names, self.block_kinds = block_names, block_kinds
        self.rules = make_rules(block_names, block_kinds, self.thresholds)
        self._static = list(static or [])
        # Keyed by (pattern, block, rank): a straggler has no block but one verdict per rank.
        self.active: dict[tuple[str, str | None, Any], Verdict] = {}
        self._pinned: set[tuple[str, str | None, Any]] = set()
        self.history: list[Verdict] = []
        self._validation: list[tuple[int, float]] = []

    def observe(self, report: Report, extra: Mapping[str, Any] | None = None) -> list[Verdict]:
        """Judge one report; return the verdicts new at this step (and every critical one).

        Args:
            report: the reduced, rank-identical step report.
            extra: further rank-identical signals (scaler, attention, compute times).
        """
        extra = dict(extra or {})
        if self._validation:
            extra["validation"] = self._validation
            self._validation = []
        emitted: list[Verdict] = []
        if self._static:
            # Wiring facts (a frozen block) hold for the whole run: no rule may clear them.
            emitted += [dataclasses.replace(v, step=report.step) for v in self._static]
            for v in emitted:
                self.active[_key(v)] = v
                self._pinned.add(_key(v))
            self._static = []
        for rule in self.rules:
            found = rule.observe(report, extra)
            if found is None:          # the rule had nothing to judge this step
                continue
            keys = {_key(v) for v in found}
            for key in [k for k in self.active
                        if k[0] in rule.patterns and k not in keys and k not in self._pinned]:
                del self.active[key]
            for v in found:
                key = _key(v)
                if v.severity == CRITICAL or key not in self.active:
                    emitted.append(v)
                self.active[key] = v
        self.history.extend(emitted)
        return emitted

    def snapshot(self) -> Any:
        """The rules' windows as they are now (a few hundred floats), for ``restore``."""
        return copy.deepcopy(self.rules)

    def restore(self, rules: Any) -> None:
        """Go back to a ``snapshot`` (the detector as it was at a checkpoint); keep the history,
        so a failure that returns after a rollback is judged against the same healthy baseline."""
        self.rules = copy.deepcopy(rules)

    def observe_validation(self, step: int, loss: float) -> None:
        """Queue a validation loss (already identical on every rank) for the next report."""
        self._validation.append((step, float(loss)))

    def is_active(self, pattern: str, block: str | None = None) -> bool:
        """Whether ``pattern`` is active now (in ``block``, when given)."""
        return any(k[0] == pattern and (block is None or k[1] == block) for k in self.active)

    def active_counts(self) -> dict[str, int]:
        """pattern -> number of (pattern, block) pairs active now."""
        counts: dict[str, int] = {}
        for pattern, _, _ in self.active:
            counts[pattern] = counts.get(pattern, 0) + 1
        return counts
