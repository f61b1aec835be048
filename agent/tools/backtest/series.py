"""What the backtest's readers produce: the points of a run's log, the series they make, the
error that names a file; and the names a log's columns, keys and tags are matched by.

A leaf of ``backtest``: ``logs`` (the text formats) and ``eventfiles`` (TensorBoard) both build
on it. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ....errors import TorchvitalsError

STEP_NAMES = (
    "step",
    "_step",
    "global_step",
    "iteration",
    "trainer/global_step",
    "train/global_step",
)
LOSS_NAMES = ("loss", "train/loss", "train/lm_loss", "lm loss", "train_loss")
GRAD_NORM_NAMES = ("grad_norm", "grad norm", "norm", "train/grad_norm", "grad-norm")
LR_NAMES = ("lr", "learning_rate", "learning rate", "train/learning_rate", "learning-rate")
"""The column names, JSON keys and TensorBoard tags read, matched in any case; where a header
has several, the first in the list wins (``grad-norm``, ``learning-rate``: Megatron's tags)."""

EVENT_FILE = "events.out.tfevents"
"""What TensorBoard's event files' names hold."""


@dataclass(frozen=True, slots=True)
class LogPoint:
    """One step of the log."""

    step: int
    loss: float | None
    """None: the line or row had no loss; NaN or Inf: the log said so."""
    grad_norm: float | None = None
    lr: float | None = None


@dataclass
class Series:
    """A run's steps, read from one or more files (pieces of one run)."""

    points: list[LogPoint]
    """Sorted by step, one per step (a later line or piece replaces an earlier one)."""
    files: list[str]
    """The files read, in order (each event file of a TensorBoard folder)."""
    columns: set[str]
    """Which of "loss", "grad_norm", "lr" any point has."""
    notes: list[str]
    """Remarks for a reader, each naming its file: steps without a loss, steps replaced."""


class LogError(TorchvitalsError, ValueError):
    """A log that cannot be read; ``str(e)`` is one line, ``<file>: <problem>`` (``path``,
    ``problem``)."""

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, " ".join(problem.split("\n"))
        super().__init__(f"{path}: {self.problem}")


class NoLoss(LogError):
    """An event file without a loss tag: an error alone, skipped inside a folder."""


@dataclass
class Piece:
    """One file's steps: the last point logged for each step, and which steps came again."""

    name: str
    unit: str
    """What a point was in the file ("rows", "lines", "iterations", "steps")."""
    points: dict[int, LogPoint] = field(default_factory=dict)
    again: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def few(items: Sequence[Any], most: int = 10) -> str:
    text = ", ".join(str(x) for x in items[:most])
    return text + (f", ... ({len(items)} in all)" if len(items) > most else "")
