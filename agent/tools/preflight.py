"""Preflight: cheap checks that rule out whole classes of bug before a long run.

    python -m torchvitals preflight mypkg.train:preflight_setup --png lr_range.png

The cheap checks worth doing before any tuning (why this order: docs/patterns.md): overfit one
tiny fixed batch (a failure means the pipeline is broken, not the hyperparameters), sweep the
learning rate to find the instability boundary, and check the optimizer and train/eval wiring.
``loss_fn(model, batch) -> loss`` throughout.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..agent import watch
from ..detect.verdict import CRITICAL
from ..detect.wiring import Finding, wiring_checks

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class PreflightResult:
    """Outcome of the memorization test."""

    passed: bool
    reason: str
    initial_loss: float
    final_loss: float
    steps: int


@dataclass
class LRRangeResult:
    """Outcome of the learning-rate range test; the lists are per sweep step."""

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    boundary_lr: float | None
    """LR where the smoothed loss rose well above its minimum or went non-finite; None if never."""
    suggested_lr: float
    """A tenth of the boundary (of lr_max when no boundary was reached)."""
    png: str | None = None

    @property
    def passed(self) -> bool:
        """Whether some learning rate made the loss fall at all."""
        finite = [x for x in self.smoothed if math.isfinite(x)]
        return len(finite) > 1 and min(finite) < finite[0]


@dataclass
class PreflightReport:
    """All three checks; ``passed`` needs memorization, a falling LR sweep, no critical finding."""

    memorization: PreflightResult
    lr_range: LRRangeResult
    findings: list[Finding] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            self.memorization.passed
            and self.lr_range.passed
            and not any(f.severity == CRITICAL for f in self.findings)
        )

    def render(self) -> str:
        """The report as readable lines for a terminal."""
        m, r, ok = self.memorization, self.lr_range, ("FAIL", "pass")
        edge = f"boundary {r.boundary_lr:.3g}" if r.boundary_lr else "no boundary below lr_max"
        return "\n".join(
            [
                f"preflight: {'PASSED' if self.passed else 'FAILED'}",
                f"memorization: {ok[m.passed]}: {m.reason}",
                f"lr range: {ok[r.passed]}: {edge}, suggested lr {r.suggested_lr:.3g}"
                + (f" (plot: {r.png})" if r.png else ""),
                f"wiring: {len(self.findings)} finding(s)"
                if self.findings
                else "wiring: no findings",
                *(f"  [{f.severity}] {f.check} {f.subject}: {f.message}" for f in self.findings),
            ]
        )


def memorization_test(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    optimizer: Any = None,
    steps: int = 300,
    target_ratio: float = 1e-2,
) -> PreflightResult:
    """Overfit one small fixed batch (~12 examples) under torchvitals and explain a failure.

    Args:
        model: the model to train (it is trained in place: pass a copy to keep yours).
        loss_fn: ``loss_fn(model, batch) -> scalar loss tensor``; the loss must be positive.
        batch: the fixed batch, whatever ``loss_fn`` takes.
        optimizer: an optimizer over ``model``'s parameters, a callable params -> optimizer, or
            None for Adam(lr=3e-3).
        steps: the most steps to take; the test stops as soon as the target is met.
        target_ratio: pass when the loss reaches this fraction of the initial loss.

    Returns:
        The result; on failure ``reason`` names the signal that looked wrong.
    """
    opt = (
        optimizer
        if isinstance(optimizer, torch.optim.Optimizer)
        else _make_optimizer(optimizer, model)
    )
    # Only grad norms and the loss are read: skip the activation hooks and parameter snapshots.
    agent = watch(model, opt, metrics_port=0, log_dir="", activations=False, update_ratio=False)
    model.train()
    first = last = math.nan
    zero_blocks, all_zero, step, patterns = None, True, 0, set()
    try:
        for step in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            if not loss.requires_grad:
                return PreflightResult(
                    False,
                    "no gradient: the loss does not require grad, so it is "
                    "detached from every parameter",
                    float(loss),
                    float(loss),
                    step,
                )
            loss.backward()
            report = agent.step(loss)
            last = report.loss
            patterns |= {v.pattern for v in report.verdicts}
            first = last if step == 1 else first
            if report.nonfinite:
                return PreflightResult(
                    False,
                    f"numerical: the loss or gradient became non-finite at "
                    f"step {step} (check log/exp/division, precision, the LR)",
                    first,
                    last,
                    step,
                )
            zero = {b for b, v in report.grad_norm.items() if v == 0} | set(
                report.grad_norm_missing
            )  # no gradient to read: none either
            zero_blocks = zero if zero_blocks is None else zero_blocks & zero
            all_zero = all_zero and report.grad_norm_total == 0
            # Without gradients nothing updates: the remaining steps could not differ.
            if last <= target_ratio * first or (all_zero and step >= 10):
                break
    finally:
        agent.close()
    ratio = last / first if first else math.nan
    passed = ratio <= target_ratio
    blocks = ", ".join(sorted(zero_blocks or ()))
    if passed:
        reason = f"loss {first:.4g} -> {last:.4g} ({ratio:.2g}x) in {step} steps"
        reason += f"; but block(s) {blocks} got no gradient" if blocks else ""
    elif all_zero:
        reason = (
            "no gradient: the total grad norm was exactly 0 at every step, so the loss is "
            "detached from the parameters (.detach(), .item(), no_grad or a rebuilt tensor)"
        )
    elif blocks:
        reason = (
            f"block(s) {blocks} get no gradient (grad norm exactly 0 at every step): frozen, "
            f"unused in forward, or detached"
        )
    elif ratio > 0.9:
        reason = (
            f"loss flat ({first:.4g} -> {last:.4g}) with non-zero gradients: check the learning "
            f"rate (lr_range_test) and that the optimizer holds and steps these parameters"
        )
    else:
        reason = (
            f"loss fell only to {ratio:.2g}x of its initial value in {step} steps (target "
            f"{target_ratio:g}): raise steps or LR, add capacity, or check the labels are "
            "consistent"
        )
    if patterns and not passed:
        reason += f" [detector: {', '.join(sorted(patterns))}]"
    return PreflightResult(passed, reason, first, last, step)


def lr_range_test(
    model_factory: Callable[[], nn.Module],
    loss_fn: LossFn,
    batches: Iterable[Any],
    lr_min: float = 1e-6,
    lr_max: float = 1.0,
    steps: int = 100,
    png: str | None = None,
    optimizer: Any = None,
    diverge_factor: float = 4.0,
) -> LRRangeResult:
    """Sweep the learning rate exponentially on a fresh model and find the instability boundary.

    Args:
        model_factory: returns a fresh model.
        loss_fn: ``loss_fn(model, batch) -> scalar loss tensor``.
        batches: the batches, cycled through (a list or a finite/infinite iterable).
        lr_min: the first learning rate.
        lr_max: the last learning rate.
        steps: sweep length; the sweep stops at the boundary.
        png: save a plot (loss vs LR, boundary and suggestion marked) here; needs matplotlib.
        optimizer: a callable params -> optimizer (its LR is overridden), or None for Adam.
        diverge_factor: the boundary is where the smoothed loss exceeds this x its minimum (or
            loses a quarter of its progress, or goes non-finite).

    Returns:
        The sweep, the boundary and the suggested learning rate.
    """
    if not 0 < lr_min < lr_max:
        raise ValueError(f"need 0 < lr_min < lr_max, got {lr_min}, {lr_max}")
    model = model_factory().train()
    opt = _make_optimizer(optimizer, model)
    lrs, losses, smoothed = [], [], []
    avg, best, boundary, beta = 0.0, math.inf, None, 0.9
    for i, batch in enumerate(itertools.islice(itertools.cycle(batches), steps)):
        lr = lr_min * (lr_max / lr_min) ** (i / max(steps - 1, 1))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        value = float(loss.detach())
        if math.isfinite(value):
            loss.backward()
            opt.step()
        avg = beta * avg + (1 - beta) * value
        smooth = avg / (1 - beta ** (i + 1))  # bias-corrected EMA: the first values are not ~0
        lrs.append(lr)
        losses.append(value)
        smoothed.append(smooth)
        # k x the minimum (fastai's stop rule) misses a cross-entropy that climbs back toward its
        # start without quadrupling: losing a quarter of the progress made (and 10% of the
        # initial loss, which EMA-smoothed batch noise stays well under) also marks the boundary.
        rise = max(0.25 * (smoothed[0] - best), 0.1 * abs(smoothed[0]))
        if not math.isfinite(smooth) or smooth > min(diverge_factor * best, best + rise):
            boundary = lr
            break
        best = min(best, smooth)
    if not lrs:
        raise ValueError("lr_range_test: no batches")
    result = LRRangeResult(lrs, losses, smoothed, boundary, (boundary or lr_max) / 10, png)
    if png:
        _plot(result, png)
    return result


def preflight(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    batches: Iterable[Any] | None = None,
    *,
    optimizer: Any = None,
    evaluate: Callable[[nn.Module], Any] | None = None,
    model_factory: Callable[[], nn.Module] | None = None,
    steps: int = 300,
    lr_steps: int = 100,
    lr_min: float = 1e-6,
    lr_max: float = 1.0,
    png: str | None = None,
) -> PreflightReport:
    """Run the wiring checks, the memorization test and the LR range test; ``model`` is not trained.

    Args:
        model: the model as it will be trained.
        loss_fn: ``loss_fn(model, batch) -> scalar loss tensor``.
        batch: a small fixed batch (~12 examples) for the memorization test.
        batches: batches for the LR range test (default: ``[batch]``).
        optimizer: an optimizer over ``model``'s parameters (the copies get the same class and
            defaults), a callable params -> optimizer, or None for Adam(lr=3e-3).
        evaluate: ``evaluate(model)``, the user's evaluation, for the train/eval-mode check.
        model_factory: fresh models for the LR test (default: copies of ``model``).
        steps: memorization steps.
        lr_steps: LR range test steps.
        lr_min: the LR sweep's start.
        lr_max: the LR sweep's end.
        png: where to save the LR range plot.

    Returns:
        The PreflightReport.
    """
    initial = copy.deepcopy(model)
    make = (
        (lambda ps, o=optimizer: type(o)(ps, **o.defaults))
        if isinstance(optimizer, torch.optim.Optimizer)
        else optimizer
    )
    live = (
        optimizer if isinstance(optimizer, torch.optim.Optimizer) else _make_optimizer(make, model)
    )
    findings = wiring_checks(model, live, evaluate)
    memo = memorization_test(copy.deepcopy(initial), loss_fn, batch, make, steps)
    lr = lr_range_test(
        model_factory or (lambda: copy.deepcopy(initial)),
        loss_fn,
        [batch] if batches is None else batches,
        lr_min,
        lr_max,
        lr_steps,
        png,
        make,
    )
    return PreflightReport(memo, lr, findings)


def load_setup(spec: str) -> dict[str, Any]:
    """Import ``MODULE:FACTORY`` and call it for the keyword arguments of ``preflight``.

    Args:
        spec: ``package.module:callable`` returning a dict with ``model``, ``loss_fn``, ``batch``
            and optionally ``batches``, ``optimizer``, ``evaluate``, ``model_factory``.

    Returns:
        The dict, checked: ``preflight(**setup)`` runs it.

    Raises:
        ValueError: a malformed spec, or a dict with a key missing or unknown.
        ImportError, AttributeError: no such module or callable.
    """
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"expected MODULE:FACTORY, got {spec!r}")
    setup = getattr(importlib.import_module(module), name)()
    known = {"model", "loss_fn", "batch", "batches", "optimizer", "evaluate", "model_factory"}
    missing, unknown = {"model", "loss_fn", "batch"} - set(setup), set(setup) - known
    if missing or unknown:
        raise ValueError(
            f"{spec} returned a dict missing {sorted(missing)} / with unknown "
            f"{sorted(unknown)}; keys: {sorted(known)}"
        )
    return setup


def _make_optimizer(spec: Any, model: nn.Module) -> torch.optim.Optimizer:
    # Adam at 3e-3, not 1e-3: a dozen examples tolerate a hotter rate, and it takes a small
    # transformer to 1% of its loss in ~85 steps where 1e-3 needs ~270 of the 300.
    return (
        spec(model.parameters())
        if spec is not None
        else torch.optim.Adam(model.parameters(), lr=3e-3)
    )


def _plot(result: LRRangeResult, path: str) -> None:
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
    except ImportError as exc:
        raise ImportError("the LR range plot needs matplotlib: pip install matplotlib") from exc
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    for ys, style in (
        (result.losses, dict(alpha=0.35, label="loss")),
        (result.smoothed, dict(label="smoothed loss (EMA)")),
    ):
        ax.plot(result.lrs, [y if math.isfinite(y) else math.nan for y in ys], **style)
    if result.boundary_lr:
        ax.axvline(
            result.boundary_lr, color="tab:red", ls="--", label=f"boundary {result.boundary_lr:.2g}"
        )
    ax.axvline(
        result.suggested_lr, color="tab:green", ls=":", label=f"suggested {result.suggested_lr:.2g}"
    )
    ax.set(xscale="log", xlabel="learning rate", ylabel="loss", title="LR range test")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
