"""The failure fingerprints, one small rule each (what each looks like: docs/patterns.md).

A rule sees each report (and ``Observed``, the rank-identical inputs that are not report
fields) and returns the verdicts that hold now,
or None when it had nothing to judge (an unsampled step for a sampled signal), so the detector
keeps its active verdicts. Rules hold only plain Python numbers.
"""

from __future__ import annotations

import abc
import math
from collections import deque
from collections.abc import Iterable
from itertools import pairwise

from ..measure.kinds import LAYER, OTHER
from ..report import Action, Report
from .observed import Observed
from .thresholds import Thresholds
from .verdict import (
    ACTIVATION_EXPLOSION,
    ATTENTION_SATURATION,
    CRITICAL,
    DEAD_LAYER,
    DEAD_PIPELINE,
    DEAD_RELU,
    FP16_OVERFLOW,
    GENERALIZATION_GAP,
    GRAD_EXPLOSION,
    GRAD_SPIKE,
    HOT_LR,
    LAYER_DIVERGENCE,
    LOSS_DIVERGENCE,
    LOSS_OUTLIER,
    LOSS_SPIKE,
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    SATURATION,
    VANISHING_GRADIENTS,
    WARNING,
    Verdict,
)

MAD_SCALE = 1.4826  # MAD -> standard deviation for normal noise


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


class Rule(abc.ABC):
    patterns: tuple[str, ...] = ()

    @abc.abstractmethod
    def observe(self, report: Report, seen: Observed) -> list[Verdict] | None:
        """The verdicts that hold at this report, or None when there was nothing to judge."""


GRAD_RANK_NOTE = (
    "the gradients' norms are reduced over the ranks, so a non-finite gradient is told by its "
    "blocks, not its rank; under DDP or FSDP the backward pass has already averaged one rank's "
    "NaN into every rank's gradients. The rank is named by its own loss when that was non-finite"
)


def named_ranks(
    ranks: list[int], count: int, what: str, where: str = "each rank's torchvitals_local_loss"
) -> dict[str, object]:
    """Ranks told by the step's sums (``measure/ranksum.py``), as evidence: the ranks, their
    count, and why they are not named when three and more flagged (``what`` they were;
    ``where`` each rank's own value is seen, "" when nowhere)."""
    found: dict[str, object] = {"ranks": list(ranks), "rank_count": count}
    if count > 2:
        found["ranks_unknown"] = (
            f"{count} ranks' {what}: which ones cannot be told from the step's sums"
            + (f" ({where} names it)" if where else "")
        )
    return found


def nonfinite_ranks(report: Report) -> dict[str, object]:
    """Which ranks' own loss was non-finite, as evidence."""
    return named_ranks(
        report.nonfinite_ranks, report.nonfinite_rank_count, "losses were non-finite"
    )


class NonFinite(Rule):
    """A NaN/Inf loss or gradient, with the ranks whose own loss it was (one or two named
    exactly, from the step's sums) and the blocks whose gradient norm it reached."""

    patterns = (NONFINITE_LOSS, NONFINITE_GRAD)

    def observe(self, report, seen):
        found = []
        if report.nonfinite_loss:
            found.append(
                Verdict(
                    NONFINITE_LOSS,
                    CRITICAL,
                    report.step,
                    None,
                    {"loss": report.loss, **nonfinite_ranks(report)},
                )
            )
        if report.nonfinite_grad and not report.overflow:
            bad = [
                b
                for b, v in report.grad_norm.items()
                if not math.isfinite(v) and b not in report.grad_norm_missing
            ]
            evidence = {
                "blocks": bad,
                "grad_norm_total": report.grad_norm_total,
                **nonfinite_ranks(report),
            }
            if report.world_size > 1:
                evidence["ranks_note"] = GRAD_RANK_NOTE
            found.append(
                Verdict(NONFINITE_GRAD, CRITICAL, report.step, bad[0] if bad else None, evidence)
            )
        return found


def culprits(report: Report) -> dict[str, object]:
    """The ranks whose own loss alone could have lifted the mean past the threshold (one or
    two named exactly: ``signals/loss.py``), else, on a sampled step, those whose own
    activations were far out while others' were not (``signals/activations.py``), as evidence
    with ``culprit_from`` saying which; nothing when no rank stood out (a spike every rank
    shares: a learning rate, a data shard all read)."""
    if report.spike_rank_count:
        found = named_ranks(report.spike_ranks, report.spike_rank_count, "own losses were far out")
        return {**found, "culprit_from": "loss"}
    if 0 < report.activation_rank_count < report.world_size:
        found = named_ranks(
            report.activation_ranks,
            report.activation_rank_count,
            "own activations were far out",
            "",
        )
        return {**found, "culprit_from": "activations"}
    return {}


class LossSpike(Rule):
    """Robust z-score of the loss against a rolling median/MAD of the healthy losses: a
    ``loss_spike`` once it persists, a ``loss_outlier`` on its first step when far out, and a
    ``loss_divergence`` when the median itself climbs from the lowest it reached."""

    patterns = (LOSS_SPIKE, LOSS_OUTLIER, LOSS_DIVERGENCE)

    def __init__(self, t: Thresholds, norms: BlockNorms):
        self.t, self.norms = t, norms
        self.losses: deque[float] = deque(maxlen=t.window)
        self.above: deque[bool] = deque(maxlen=t.loss_spike_recent)
        self.early: float | None = None
        self.best: float | None = None
        """The lowest rolling median so far (the level a slow divergence climbs from)."""
        self.rising = 0
        """Consecutive judged steps whose median lay ``loss_divergence_rise`` above ``best``."""
        self.flagged = False
        """Whether this step's loss lay past the spike threshold (``GradSpike`` reads it)."""
        self.level: tuple[float, float] | None = None
        """(median, threshold) of the last judged step: what the next step's ranks compare
        their own loss with (``Detector.loss_level``, the loss signal's culprit flag)."""

    def observe(self, report, seen):
        self.flagged = False
        loss = report.loss
        if not math.isfinite(loss):
            return []
        if self.early is None:
            self.early = abs(loss)  # the loss's natural scale: where training started
        if report.step <= self.t.warmup_steps or len(self.losses) < self.t.min_history:
            if report.step > self.t.warmup_steps:
                self.losses.append(loss)
            return []
        # The level is the window's median, slow on purpose so a gradual divergence does not
        # drag it along; the noise comes from step-to-step differences, which a falling trend
        # does not inflate (a MAD around the median would, and hide a tripled loss).
        center = median(self.losses)
        values = list(self.losses)
        diffs = [b - a for a, b in pairwise(values)]
        spread = mad(diffs, median(diffs)) / math.sqrt(2)
        floor = self.t.loss_spike_abs_floor * self.early
        scale = max(MAD_SCALE * spread, self.t.loss_spike_floor * abs(center), floor)
        threshold = center + self.t.loss_spike_mads * scale
        self.above.append(loss > threshold)
        self.flagged = self.above[-1]
        self.level = (center, threshold)
        found = self._divergence(report.step, center, floor)
        # One noisy batch a little past the threshold is not a spike (Thresholds.loss_spike_recent),
        # and one far past it is an outlier the next batch may heal (loss_spike_severe).
        severe = loss > center + self.t.loss_spike_severe * self.t.loss_spike_mads * scale
        persists = sum(self.above) >= self.t.loss_spike_recent_hits
        if self.above[-1] and (persists or severe):
            evidence = {
                "loss": loss,
                "median": center,
                "mad": spread,
                "scale": scale,
                "threshold": threshold,
                "fired": "loss_spike_mads" if persists else "loss_spike_severe",
                "loss_spike_mads": self.t.loss_spike_mads,
                "window": len(self.losses),
                "z": (loss - center) / scale,
                **culprits(report),
            }
            pattern, severity = (LOSS_SPIKE, CRITICAL) if persists else (LOSS_OUTLIER, WARNING)
            block = self.norms.leader()
            found.append(Verdict(pattern, severity, report.step, block, evidence))
        if not self.above[-1]:
            self.losses.append(loss)
        return found

    def _divergence(self, step: int, center: float, floor: float) -> list[Verdict]:
        """The median's climb from the lowest it reached, judged on every step."""
        if self.best is None or center < self.best:
            self.best = center
        rise = center - self.best
        climbing = rise > max(self.t.loss_divergence_rise * abs(self.best), floor)
        self.rising = self.rising + 1 if climbing else 0
        if self.rising < self.t.loss_divergence_steps:
            return []
        evidence = {
            "median": center,
            "lowest_median": self.best,
            "rise": rise / abs(self.best) if self.best else math.inf,
            "steps": self.rising,
            "fired": "loss_divergence_rise",
            "loss_divergence_rise": self.t.loss_divergence_rise,
        }
        return [Verdict(LOSS_DIVERGENCE, WARNING, step, None, evidence)]


class GradSpike(Rule):
    """The total gradient norm far above its rolling median while the loss did not move: a
    warning (a loss that moves too is the spike rule's)."""

    patterns = (GRAD_SPIKE,)

    def __init__(self, t: Thresholds, norms: BlockNorms, losses: LossSpike):
        self.t, self.norms, self.losses = t, norms, losses

    def observe(self, report, seen):
        total = report.grad_norm_total
        history = self.norms.totals
        if (
            not math.isfinite(total)
            or report.step <= self.t.warmup_steps
            or len(history) < self.t.min_history
            or self.losses.flagged
        ):
            return []
        base = median(history)
        if base > 0 and total >= self.t.grad_spike_factor * base:
            evidence = {
                "grad_norm_total": total,
                "median": base,
                "ratio": total / base,
                "loss": report.loss,
                "fired": "grad_spike_factor",
                "grad_spike_factor": self.t.grad_spike_factor,
                **culprits(report),
            }
            return [Verdict(GRAD_SPIKE, WARNING, report.step, self.norms.leader(), evidence)]
        return []


class BlockNorms(Rule):
    """Gradient explosion (total norm growing geometrically) and one block leaving the cluster."""

    patterns = (GRAD_EXPLOSION, LAYER_DIVERGENCE)

    def __init__(self, t: Thresholds, names: list[str]):
        self.t, self.names = t, names
        self.totals: deque[float] = deque(maxlen=t.window)
        self.recent: deque[float] = deque(maxlen=t.explosion_steps + 1)
        self.blocks: dict[str, deque[float]] = {b: deque(maxlen=t.window) for b in names}
        self.ratios: dict[str, float] = {}
        self.diverging: str | None = None

    def leader(self) -> str | None:
        """The block whose grad norm rose most over its own median at the last step ("other",
        the small leftovers such as final norms, only when no named block has a ratio)."""
        finite = {b: r for b, r in self.ratios.items() if math.isfinite(r)}
        named = {b: r for b, r in finite.items() if b != OTHER} or finite
        return max(named, key=named.__getitem__) if named else None

    def observe(self, report, seen):
        total = report.grad_norm_total
        if not math.isfinite(total) or (report.action == Action.SKIP and total == 0):
            return []
        self.ratios = {}
        for b, v in report.grad_norm.items():
            base = median(self.blocks[b]) if len(self.blocks[b]) >= self.t.min_history else math.nan
            self.ratios[b] = v / base if base > 0 else math.nan
        found = []
        self.recent.append(total)
        judged = len(self.totals) >= self.t.min_history
        if judged and len(self.recent) == self.recent.maxlen:
            growth = [
                b / a if a > 0 else math.inf for a, b in zip(self.recent, list(self.recent)[1:])
            ]
            base = median(self.totals)
            if min(growth) >= self.t.explosion_growth and total >= self.t.explosion_factor * base:
                found.append(
                    Verdict(
                        GRAD_EXPLOSION,
                        WARNING,
                        report.step,
                        self.leader(),
                        {
                            "grad_norm_total": total,
                            "median": base,
                            "growth": growth,
                            "fired": "explosion_growth",
                            "explosion_growth": self.t.explosion_growth,
                            "explosion_factor": self.t.explosion_factor,
                        },
                    )
                )
        if judged:
            found += self._divergence(report)
        if report.step > self.t.warmup_steps and not found:
            self.totals.append(total)
            for b, v in report.grad_norm.items():
                if b not in report.grad_norm_missing:  # unmeasured: no history either
                    self.blocks[b].append(v)
        return found

    def _divergence(self, report):
        finite = {b: r for b, r in self.ratios.items() if math.isfinite(r) and b != OTHER}
        if len(finite) < 3:
            return []
        top = max(finite, key=finite.__getitem__)
        others = median(r for b, r in finite.items() if b != top)
        out = finite[top] >= self.t.divergence_factor and others <= self.t.divergence_cluster
        previous, self.diverging = self.diverging, top if out else None
        if out and previous == top:
            return [
                Verdict(
                    LAYER_DIVERGENCE,
                    WARNING,
                    report.step,
                    top,
                    {
                        "ratio_to_median": finite[top],
                        "others_median_ratio": others,
                        "grad_norm": report.grad_norm[top],
                        "fired": "divergence_factor",
                        "divergence_factor": self.t.divergence_factor,
                    },
                )
            ]
        return []


class UpdateRatios(Rule):
    """Hot learning rate (ratio far above 1e-3 and rising) and dead/frozen layers (~0)."""

    patterns = (HOT_LR, DEAD_LAYER)

    def __init__(self, t: Thresholds, names: list[str]):
        self.t = t
        self.history: dict[str, deque[float]] = {b: deque(maxlen=t.window) for b in names}
        self.dead_run = {b: 0 for b in names}

    def observe(self, report, seen):
        ratios = report.update_ratio
        if not ratios:
            return None
        found = []
        for b, r in ratios.items():
            past = self.history[b]
            if (
                report.step > self.t.warmup_steps
                and len(past) >= 2
                and r >= self.t.hot_lr_ratio
                and r >= self.t.hot_lr_rise * median(past)
            ):
                found.append(
                    Verdict(
                        HOT_LR,
                        WARNING,
                        report.step,
                        b,
                        {
                            "update_ratio": r,
                            "earlier_median": median(past),
                            "healthy": self.t.healthy_update_ratio,
                            "fired": "hot_lr_ratio",
                            "hot_lr_ratio": self.t.hot_lr_ratio,
                            "hot_lr_rise": self.t.hot_lr_rise,
                        },
                    )
                )
            else:
                past.append(r)
        for b, r in ratios.items():
            others = [v for o, v in ratios.items() if o != b and o != OTHER]
            moving = others and median(others) >= self.t.dead_moving_factor * self.t.dead_ratio
            self.dead_run[b] = self.dead_run[b] + 1 if r <= self.t.dead_ratio and moving else 0
            if self.dead_run[b] >= self.t.dead_samples:
                found.append(
                    Verdict(
                        DEAD_LAYER,
                        WARNING,
                        report.step,
                        b,
                        {
                            "update_ratio": r,
                            "others_median": median(others),
                            "samples": self.dead_run[b],
                            "fired": "dead_ratio",
                            "dead_ratio": self.t.dead_ratio,
                        },
                    )
                )
        return found


class Vanishing(Rule):
    """Last-layer over first-layer gradient norm beyond ~100x for a few steps.

    Only the repeated layers are compared: an embedding's gradient is sparse and a head's is
    the loss's own, so their ratio is large on healthy runs (measured 166x on torchtitan's
    debug llama3); with fewer than two layers there is no depth to vanish across.
    """

    patterns = (VANISHING_GRADIENTS,)

    def __init__(self, t: Thresholds, names: list[str], kinds: list[str]):
        self.t = t
        layers = [n for n, k in zip(names, kinds) if k == LAYER]
        self.first: str | None = None
        self.last: str | None = None
        if len(layers) >= 2:
            self.first, self.last = layers[0], layers[-1]
        self.run = 0

    def observe(self, report, seen):
        if self.first is None or report.nonfinite:
            return []
        if self.first in report.grad_norm_missing or self.last in report.grad_norm_missing:
            self.run = 0  # an unmeasured end is no evidence either way
            return []
        first, last = report.grad_norm[self.first], report.grad_norm[self.last]
        ratio = last / first if first > 0 else (math.inf if last > 0 else 0.0)
        self.run = self.run + 1 if ratio >= self.t.vanishing_ratio else 0
        if self.run >= self.t.vanishing_steps:
            return [
                Verdict(
                    VANISHING_GRADIENTS,
                    WARNING,
                    report.step,
                    self.first,
                    {
                        "first": self.first,
                        "last": self.last,
                        "ratio": ratio,
                        "first_grad_norm": first,
                        "last_grad_norm": last,
                        "steps": self.run,
                        "fired": "vanishing_ratio",
                        "vanishing_ratio": self.t.vanishing_ratio,
                    },
                )
            ]
        return []


class Activations(Rule):
    """Saturated tanh/sigmoid outputs, dead ReLUs, and activations exploding from the start."""

    patterns = (SATURATION, DEAD_RELU, ACTIVATION_EXPLOSION)

    def __init__(self, t: Thresholds):
        self.t = t
        self.first: dict[str, float] = {}
        self.high_run: dict[str, int] = {}
        self.settled: set[str] = set()
        """Blocks whose abs max once fell below ``explosion_hold`` of the first: never judged
        again for an explosion."""

    def observe(self, report, seen):
        acts = report.activations
        if not acts:
            return None
        found = []
        for b, a in acts.items():
            if (
                a["abs_max"] <= 1.0 + 1e-6
                and a["saturation_fraction"] >= self.t.saturation_fraction
            ):
                found.append(
                    Verdict(
                        SATURATION,
                        WARNING,
                        report.step,
                        b,
                        {
                            "saturation_fraction": a["saturation_fraction"],
                            "abs_max": a["abs_max"],
                            "fired": "saturation_fraction",
                            "saturation_fraction_threshold": self.t.saturation_fraction,
                        },
                    )
                )
            if a["zero_fraction"] >= self.t.dead_relu_fraction:
                found.append(
                    Verdict(
                        DEAD_RELU,
                        WARNING,
                        report.step,
                        b,
                        {
                            "zero_fraction": a["zero_fraction"],
                            "fired": "dead_relu_fraction",
                            "dead_relu_fraction": self.t.dead_relu_fraction,
                        },
                    )
                )
            first = self.first.setdefault(b, a["abs_max"])
            high = (
                first >= self.t.explosion_abs_max and a["abs_max"] >= self.t.explosion_hold * first
            )
            if not high:
                self.settled.add(b)
            if b in self.settled:
                continue
            self.high_run[b] = self.high_run.get(b, 0) + 1
            if self.high_run[b] >= self.t.explosion_samples:
                found.append(
                    Verdict(
                        ACTIVATION_EXPLOSION,
                        WARNING,
                        report.step,
                        b,
                        {
                            "abs_max": a["abs_max"],
                            "first_abs_max": first,
                            "samples": self.high_run[b],
                            "fired": "explosion_abs_max",
                            "explosion_abs_max": self.t.explosion_abs_max,
                        },
                    )
                )
        return found


class AttentionSaturation(Rule):
    """One head's softmax going one-hot: its entropy collapses, or the max logit grows huge."""

    patterns = (ATTENTION_SATURATION,)

    def __init__(self, t: Thresholds):
        self.t = t

    def observe(self, report, seen):
        seen = {b: a for b, a in report.activations.items() if "attention_entropy" in a}
        if not seen:
            return None
        found = []
        for b, a in seen.items():
            entropy, logit = a["attention_entropy"], a.get("attention_logit_max", math.nan)
            if entropy <= self.t.attention_entropy or logit >= self.t.attention_logit:
                found.append(
                    Verdict(
                        ATTENTION_SATURATION,
                        WARNING,
                        report.step,
                        b,
                        {
                            "entropy_min": entropy,
                            "logit_max": logit,
                            "fired": "attention_entropy"
                            if entropy <= self.t.attention_entropy
                            else "attention_logit",
                            "attention_entropy": self.t.attention_entropy,
                            "attention_logit": self.t.attention_logit,
                        },
                    )
                )
        return found


class DeadPipeline(Rule):
    """Flat loss from the first step with exactly-zero or tiny gradients."""

    patterns = (DEAD_PIPELINE,)

    def __init__(self, t: Thresholds):
        self.t = t
        # A pipeline dead from the start may stay so for the whole run: the series since step 1
        # is held as running extremes (first value, then each strictly beyond it, as max/min
        # over the series give) and the median of the newest losses, which sets the scale of
        # "flat": every loss lies within the spread, so any of their medians serves.
        self.steps = 0
        self.low: float | None = None
        self.high: float | None = None
        self.recent: deque[float] = deque(maxlen=max(t.window, t.dead_pipeline_steps))
        self.max_norm: float | None = None
        self.zero = True
        self.live = True

    def observe(self, report, seen):
        if not self.live:
            return []
        if (
            report.grad_norm_missing
            and not math.isfinite(report.grad_norm_total)
            and not report.nonfinite_grad
        ):
            return []  # no block's gradient could be read: nothing to judge
        loss, norm = report.loss, report.grad_norm_total
        self.steps += 1
        self.low = loss if self.low is None or loss < self.low else self.low
        self.high = loss if self.high is None or loss > self.high else self.high
        self.recent.append(loss)
        self.max_norm = norm if self.max_norm is None or norm > self.max_norm else self.max_norm
        self.zero = self.zero and norm == 0
        n_needed = self.t.dead_pipeline_zero_steps if self.zero else self.t.dead_pipeline_steps
        if self.steps < n_needed:
            return []
        spread = self.high - self.low
        flat = spread <= self.t.dead_pipeline_flat * abs(median(self.recent)) + 1e-8
        tiny = self.max_norm <= self.t.tiny_grad
        if (flat or self.zero) and tiny:
            return [
                Verdict(
                    DEAD_PIPELINE,
                    WARNING,
                    report.step,
                    None,
                    {
                        "steps": self.steps,
                        "loss_spread": spread,
                        "max_grad_norm": self.max_norm,
                        "detached": self.zero,
                        "fired": "tiny_grad",
                        "tiny_grad": self.t.tiny_grad,
                    },
                )
            ]
        self.live = False  # the run came alive: the pattern is "from the start" only
        return []


class Fp16Overflow(Rule):
    """GradScaler overflows: Inf gradients, a halved scale and a skipped step, again and again."""

    patterns = (FP16_OVERFLOW,)

    def __init__(self, t: Thresholds):
        self.t = t
        self.overflows: deque[int] = deque()
        self.scales: deque[float] = deque(maxlen=8)

    def observe(self, report, seen):
        if report.loss_scale is None:  # the step went through no GradScaler
            return None
        self.scales.append(report.loss_scale)
        if report.overflow:
            self.overflows.append(report.step)
        while self.overflows and self.overflows[0] <= report.step - self.t.window:
            self.overflows.popleft()
        if len(self.overflows) >= self.t.overflow_skips:
            return [
                Verdict(
                    FP16_OVERFLOW,
                    WARNING,
                    report.step,
                    None,
                    {
                        "skipped_steps": list(self.overflows),
                        "scales": list(self.scales),
                        "window": self.t.window,
                        "fired": "overflow_skips",
                        "overflow_skips": self.t.overflow_skips,
                    },
                )
            ]
        return []


class GeneralizationGap(Rule):
    """Validation loss rising over several reports while the training loss keeps falling."""

    patterns = (GENERALIZATION_GAP,)

    def __init__(self, t: Thresholds):
        self.t = t
        self.train_ema: float | None = None
        # What a judgement reads: the newest validations and the best one so far (the first,
        # then each strictly lower, as min over every validation gives).
        self.points: deque[tuple[int, float, float]] = deque(maxlen=t.gap_validations + 1)
        self.best: float | None = None

    def observe(self, report, seen):
        if math.isfinite(report.loss):
            self.train_ema = (
                report.loss if self.train_ema is None else 0.9 * self.train_ema + 0.1 * report.loss
            )
        new = seen.validation
        if not new:
            return None
        for step, loss in new:
            self.points.append(
                (step, loss, self.train_ema if self.train_ema is not None else math.nan)
            )
            self.best = loss if self.best is None or loss < self.best else self.best
        if len(self.points) < self.t.gap_validations + 1 or self.best is None:
            return []
        val = [p[1] for p in self.points]
        train = [p[2] for p in self.points]
        best = self.best
        rise = 1 + self.t.gap_min_rise
        # Each rise must add up to a real one inside the window, not creep on a plateau.
        rising = (
            all(b > a for a, b in pairwise(val))
            and val[-1] >= best * rise
            and val[-1] >= val[0] * rise
        )
        falling = all(b < a for a, b in pairwise(train))
        if rising and falling:
            return [
                Verdict(
                    GENERALIZATION_GAP,
                    WARNING,
                    report.step,
                    None,
                    {
                        "validation": val,
                        "training": train,
                        "best_validation": best,
                        "fired": "gap_min_rise",
                        "gap_min_rise": self.t.gap_min_rise,
                    },
                )
            ]
        return []


def make_rules(names: list[str], kinds: list[str], t: Thresholds) -> list[Rule]:
    norms = BlockNorms(t, names)
    losses = LossSpike(t, norms)
    return [
        NonFinite(),
        norms,
        losses,
        GradSpike(t, norms, losses),
        UpdateRatios(t, names),
        Vanishing(t, names, kinds),
        Activations(t),
        AttentionSaturation(t),
        DeadPipeline(t),
        Fp16Overflow(t),
        GeneralizationGap(t),
    ]
