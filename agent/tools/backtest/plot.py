"""The backtest's picture: the loss (and the gradient norm) of a past run, its findings marked.

    torchvitals backtest run.csv --plot run.png

The loss on top, the total gradient norm below it on a log scale when the log has one; a red
triangle at each page's first step, an orange one at each warning's, and a shaded band while a
finding held for more than a step. matplotlib's ``Figure`` only (no pyplot: the user's backend
is left alone). Torch-free.
"""

from __future__ import annotations

import math
from pathlib import Path

from ...detect.verdict import CRITICAL
from .logs import Series
from .replay import Backtest

COLORS = {CRITICAL: "#d62728", "warning": "#ff7f0e"}
"""Marker color by severity (anything else: the warning's)."""


def plot_backtest(series: Series, result: Backtest, path: str | Path) -> Path:
    """Draw ``series`` with ``result``'s episodes into the PNG ``path``; returns the path."""
    from matplotlib.figure import Figure

    path = Path(path)
    steps = [p.step for p in series.points]
    losses = [math.nan if p.loss is None else p.loss for p in series.points]
    norms = [math.nan if p.grad_norm is None else p.grad_norm for p in series.points]
    with_norm = "grad_norm" in series.columns
    fig = Figure(figsize=(12, 6.5 if with_norm else 4), layout="constrained")
    axes = fig.subplots(2 if with_norm else 1, 1, sharex=True, squeeze=False)[:, 0]
    axes[0].plot(steps, losses, lw=0.6, color="#1f77b4")
    axes[0].set_ylabel("loss")
    finite = sorted(v for v in losses if math.isfinite(v))
    if finite:  # the spikes must not squash the curve: clip the axis at a high quantile
        low, high = finite[0], finite[min(len(finite) - 1, int(0.999 * len(finite)))]
        pad = 0.05 * (high - low or abs(high) or 1.0)
        axes[0].set_ylim(low - pad, high + 6 * pad)
    if with_norm:
        axes[1].plot(steps, norms, lw=0.6, color="#7f7f7f")
        axes[1].set_yscale("log")
        axes[1].set_ylabel("grad norm")
    axes[-1].set_xlabel("step")
    at = dict(zip(steps, losses))
    for e in result.episodes:
        color = COLORS.get(e.severity, COLORS["warning"])
        for ax in axes:
            if e.until > e.step:
                ax.axvspan(e.step, e.until, color=color, alpha=0.15, lw=0)
        y = at.get(e.step, math.nan)
        if math.isfinite(y):
            top = axes[0].get_ylim()[1]
            axes[0].plot([e.step], [min(y, top)], "v", color=color, ms=7)
    title = (
        f"{', '.join(series.files) or 'records'}: {result.pages} pages, "
        f"{result.warnings} warnings over steps {result.first_step}-{result.last_step}"
    )
    axes[0].set_title(title, fontsize=9)
    fig.savefig(path, dpi=110)
    return path
