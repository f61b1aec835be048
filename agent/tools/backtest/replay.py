"""Replay a past run's log through the live detector: would it have caught what went wrong, and
how often would it have paged for nothing?

    torchvitals backtest run.csv                   # or several pieces of a resumed run, in order
    torchvitals backtest run.log.gz --json --plot run.png

    result = torchvitals.backtest("run.csv")      # or a list of dicts: step, loss, grad_norm, lr
    result.pages, result.warnings, result.episodes

Each logged step becomes the ``Report`` the agent would have reduced (its loss, its total
gradient norm, whether either was non-finite) and goes through the same ``Detector`` with the
same default ``Thresholds``: not a second implementation. A log has no per-block gradient norms,
update ratios, activations or timings, so the rules that read those stay silent; the loss and
gradient-norm rules judge exactly as they do live. The watchdog does not run: a spike the live
job would have rolled back stays in the series, and what follows is judged as it was logged.

Verdicts become episodes: a finding from the step it became active to the last step it held
(the detector emits a critical verdict every step it holds; Alertmanager pages once per firing
alert). ``pages`` counts the critical episodes, ``warnings`` the others.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...detect.detector import Detector
from ...detect.thresholds import Thresholds
from ...detect.verdict import CRITICAL, Verdict
from ...jsonsafe import json_safe
from ...report import Report
from .logs import LogPoint, Series, read_logs, read_records

PER = 100_000
"""Rates are per this many training steps (the span of the log's step numbers)."""


@dataclass(frozen=True)
class Episode:
    """One finding, from the step it became active to the last step it held."""

    pattern: str
    severity: str
    step: int
    """The step it first held (its verdict's step)."""
    until: int
    """The last logged step it held."""
    held: int
    """Logged steps it held (1 for a one-step finding)."""
    block: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    """The first verdict's evidence: the numbers and the threshold that fired."""

    def to_dict(self) -> dict[str, Any]:
        """``{"step", "pattern", "severity", "until", "held", "block"?, **evidence}``."""
        out: dict[str, Any] = {
            "step": self.step,
            "pattern": self.pattern,
            "severity": self.severity,
            "until": self.until,
            "held": self.held,
        }
        if self.block is not None:
            out["block"] = self.block
        out.update({k: v for k, v in self.evidence.items() if k not in out})
        return json_safe(out)


@dataclass
class Backtest:
    """What the detector would have said over a past run (``backtest``'s result)."""

    steps: int
    """Logged steps replayed."""
    first_step: int
    last_step: int
    episodes: list[Episode]
    """Every finding, in the order it became active."""
    files: list[str] = field(default_factory=list)
    columns: set[str] = field(default_factory=set)
    """Which of loss, grad_norm and lr the log holds."""
    notes: list[str] = field(default_factory=list)
    """The reader's remarks: lines without a loss, steps a later piece replaced."""
    seconds: float = 0.0
    """Wall time of the replay (reading excluded)."""

    @property
    def pages(self) -> int:
        """Critical episodes: what would have paged (and made the watchdog act)."""
        return sum(e.severity == CRITICAL for e in self.episodes)

    @property
    def warnings(self) -> int:
        """Warning episodes: what would have gone to a queue."""
        return sum(e.severity != CRITICAL for e in self.episodes)

    @property
    def span(self) -> int:
        """Training steps the log covers (last - first + 1; logs that print every Nth step
        cover N times their lines)."""
        return self.last_step - self.first_step + 1 if self.steps else 0

    def per_100k(self, count: int) -> float:
        """``count`` as a rate per 100,000 training steps of this log."""
        return count * PER / self.span if self.span else math.nan

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object: steps, first_step, last_step, verdicts (one per episode),
        pages, warnings, and the rates, files, columns and notes beside them."""
        return json_safe(
            {
                "steps": self.steps,
                "first_step": self.first_step,
                "last_step": self.last_step,
                "verdicts": [e.to_dict() for e in self.episodes],
                "pages": self.pages,
                "warnings": self.warnings,
                "pages_per_100k_steps": self.per_100k(self.pages),
                "warnings_per_100k_steps": self.per_100k(self.warnings),
                "files": self.files,
                "columns": sorted(self.columns),
                "notes": self.notes,
                "replay_seconds": self.seconds,
            }
        )

    def render(self) -> str:
        """The readable summary ``torchvitals backtest`` prints."""
        lines = [
            f"read {self.steps} logged steps ({self.first_step}-{self.last_step}) from "
            f"{', '.join(self.files) or 'records'}; columns: {', '.join(sorted(self.columns))}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        for severity, count, word in (
            (CRITICAL, self.pages, "pages"),
            (None, self.warnings, "warnings"),
        ):
            rate = self.per_100k(count)
            word = word if count != 1 else word[:-1]
            lines.append(f"{count} {word} ({rate:.3g} per 100k steps)")
            mine = [e for e in self.episodes if (e.severity == CRITICAL) == (severity is not None)]
            by_pattern: dict[str, list[Episode]] = {}
            for e in mine:
                by_pattern.setdefault(e.pattern, []).append(e)
            for pattern, found in sorted(by_pattern.items()):
                steps = ", ".join(_when(e) for e in found[:12])
                more = f", ... ({len(found) - 12} more)" if len(found) > 12 else ""
                lines.append(f"  {pattern} x{len(found)}: steps {steps}{more}")
        return "\n".join(lines)


def _when(e: Episode) -> str:
    return str(e.step) if e.until == e.step else f"{e.step}-{e.until}"


def report_of(point: LogPoint) -> Report:
    """The reduced report the agent would have made of one logged step."""
    loss = math.nan if point.loss is None else point.loss
    norm = math.nan if point.grad_norm is None else point.grad_norm
    bad_loss = point.loss is not None and not math.isfinite(point.loss)
    bad_grad = point.grad_norm is not None and not math.isfinite(point.grad_norm)
    return Report(
        step=point.step,
        loss=loss,
        grad_norm_total=norm,
        nonfinite_loss=bad_loss,
        nonfinite_grad=bad_grad,
        nonfinite=bad_loss or bad_grad,
    )


def replay(series: Series, thresholds: Thresholds | None = None) -> Backtest:
    """Run the detector over ``series`` step by step; the episodes it finds."""
    detector = Detector([], [], thresholds or Thresholds())
    open_: dict[tuple[str, str | None, Any], list[Any]] = {}
    """identity -> [first verdict, last step held, steps held], while active."""
    done: list[tuple[Verdict, int, int]] = []
    started = time.perf_counter()
    for point in series.points:
        detector.observe(report_of(point))
        active = detector.active
        for key in [k for k in open_ if k not in active]:
            first, last, held = open_.pop(key)
            done.append((first, last, held))
        for key, verdict in active.items():
            episode = open_.get(key)
            if episode is None:
                open_[key] = [verdict, point.step, 1]
            else:
                episode[1], episode[2] = point.step, episode[2] + 1
    done += [(first, last, held) for first, last, held in open_.values()]
    done.sort(key=lambda d: (d[0].step, d[0].pattern))
    points = series.points
    return Backtest(
        steps=len(points),
        first_step=points[0].step if points else 0,
        last_step=points[-1].step if points else 0,
        episodes=[
            Episode(v.pattern, v.severity, v.step, last, held, v.block, dict(v.evidence))
            for v, last, held in done
        ],
        files=list(series.files),
        columns=set(series.columns),
        notes=list(series.notes),
        seconds=time.perf_counter() - started,
    )


def backtest(
    source: str
    | os.PathLike[str]
    | Sequence[str | os.PathLike[str]]
    | Iterable[Mapping[str, Any]]
    | Series,
    *,
    format: str = "auto",
    detect: Mapping[str, Any] | Thresholds | None = None,
) -> Backtest:
    """Replay a past run through the live detector.

    Args:
        source: a log file (CSV, TSV, JSONL, a TensorBoard event file or folder, Megatron-style
            lines; gzipped too), a list of files that are pieces of one run in order (a later
            piece wins where steps overlap), an iterable of per-step dicts (``step``, ``loss``,
            optional ``grad_norm``, ``lr``: the keys a JSONL line holds), or a read ``Series``.
        format: the files' format, or ``auto`` (by name, then by content).
        detect: threshold overrides, as ``watch(detect=...)`` takes them (or ``Thresholds``).

    Raises:
        LogError: a file missing, unreadable, truncated or without a loss (names the file).
        ConfigError: an unknown or out-of-range threshold.
    """
    thresholds = detect if isinstance(detect, Thresholds) else Thresholds.from_overrides(detect)
    if isinstance(source, Series):
        series = source
    elif isinstance(source, (str, os.PathLike)):
        series = read_logs(source, format)  # read_logs takes one path as a list of one
    else:
        items: list[Any] = list(source)
        if items and all(isinstance(i, Mapping) for i in items):
            series = read_records(items)
        else:
            series = read_logs(items, format)
    return replay(series, thresholds)
