"""The job's timeline on disk: the records the goodput accounting reads, and their writers.

    StepTimeline(job_folder, attempt=2).step(41, end=t, seconds=0.3, data_wait=0.01)
    SupervisorTimeline(job_folder, node=0).attempt(2, start=t0, end=t1, reason="hang", status=-15)

The records it is computed from live in ``<job folder>/goodput/``, JSON lines appended and
flushed one at a time (a crash loses at most the line being written):

- ``steps-a<attempt>-p<pid>.jsonl``, written by global rank 0's agent (``StepTimeline``): a
  ``start`` line when ``watch()`` returns (with the seconds spent loading the checkpoint it
  resumed from), then one ``step`` line per step: its number, its end (unix seconds), its
  duration (from the previous step's end, or from ``watch()`` for the first), and the parts of
  it spent waiting for data and in checkpoints (a save's stall on the step, a rollback's
  restore), and the action taken.
- ``supervisor-node<n>.jsonl``, written by each node's supervisor (``SupervisorTimeline``): the
  wait for the other nodes before each attempt, each attempt's start and end (and how it ended,
  and when the fault was detected), and the end of the job.

Torch-free: the agent and the supervisor both write them, ``goodput`` reads them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import IO, Any

from .schema import (
    ACTION,
    ATTEMPT,
    BEGAN,
    CHECKPOINT,
    DATA_WAIT,
    ENDED,
    EVENT,
    RERUN,
    SCHEMA_VERSION,
    SECONDS,
    STEP,
    TIME,
    VERSION,
)
from .vocabulary import Action

log = logging.getLogger("torchvitals.goodput")

FOLDER = "goodput"
"""The records' sub-folder of the job's folder."""

STEPS_GLOB = "steps-a*-p*.jsonl"
SUPERVISOR_GLOB = "supervisor-node*.jsonl"


class _Lines:
    """An append-only JSON-lines file, each line flushed; a failing disk is logged once and the
    caller goes on (training and supervision never stop over an accounting line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self._failed = False

    def write(self, record: dict[str, Any]) -> None:
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            line = {VERSION: SCHEMA_VERSION, **record}
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._file.flush()
        except (OSError, ValueError) as exc:
            if not self._failed:
                log.warning("torchvitals: cannot write %s (%s); goes on without it", self.path, exc)
            self._failed = True

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


class StepTimeline:
    """Global rank 0's steps, for the goodput accounting.

    Args:
        folder: the job's folder.
        attempt: the supervisor's attempt (0 when unsupervised).
        pid: this process (a torchrun restart within an attempt is a new pid, a new file).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        attempt: int = 0,
        pid: int | None = None,
    ) -> None:
        pid = os.getpid() if pid is None else pid
        self.attempt, self.pid = attempt, pid
        self._lines = _Lines(Path(folder) / FOLDER / f"steps-a{attempt:04d}-p{pid}.jsonl")

    def start(self, *, at: float, resumed: int, load_seconds: float = 0.0) -> None:
        """``watch()`` returned at ``at``, resumed from step ``resumed`` (0: a fresh start) after
        ``load_seconds`` loading its checkpoint."""
        self._lines.write(
            {
                EVENT: "start",
                ATTEMPT: self.attempt,
                "pid": self.pid,
                TIME: at,
                "resumed": resumed,
                "load": load_seconds,
            }
        )

    def step(
        self,
        step: int,
        *,
        end: float,
        seconds: float,
        data_wait: float = 0.0,
        checkpoint: float = 0.0,
        action: str = Action.STEP,
        rerun: float = 0.0,
    ) -> None:
        """Step ``step`` ended at ``end`` after ``seconds`` (since the previous step's end), of
        which ``data_wait`` waiting for its batch, ``checkpoint`` saving or restoring and
        ``rerun`` computing it once more (written only when not 0)."""
        line = {
            EVENT: "step",
            STEP: step,
            TIME: end,
            SECONDS: seconds,
            DATA_WAIT: data_wait,
            CHECKPOINT: checkpoint,
            ACTION: str(action),
        }
        if rerun:
            line[RERUN] = rerun
        self._lines.write(line)

    def close(self) -> None:
        self._lines.close()


class SupervisorTimeline:
    """One node's supervisor's attempts, for the goodput accounting.

    Args:
        folder: the job's folder.
        node: this node's rank.
    """

    def __init__(self, folder: str | os.PathLike, *, node: int = 0) -> None:
        self.node = node
        self._lines = _Lines(Path(folder) / FOLDER / f"supervisor-node{node}.jsonl")

    def waited(self, attempt: int, *, start: float, end: float) -> None:
        """The node waited for the others from ``start`` to ``end`` before ``attempt``."""
        self._lines.write({EVENT: "wait", ATTEMPT: attempt, BEGAN: start, ENDED: end})

    def attempt(
        self,
        attempt: int,
        *,
        start: float,
        end: float,
        reason: str,
        status: int,
        detected: float | None = None,
    ) -> None:
        """``attempt`` ran from ``start`` to ``end`` and ended by ``reason`` ("exit", "hang",
        "peer") with the launcher's ``status``; ``detected``: when the fault that ended it was
        seen (None: at ``end``)."""
        self._lines.write(
            {
                EVENT: "attempt",
                ATTEMPT: attempt,
                BEGAN: start,
                ENDED: end,
                "reason": reason,
                "status": status,
                "detected": end if detected is None else detected,
            }
        )

    def ended(self, *, at: float, code: int) -> None:
        """This node's supervision ended at ``at`` with exit status ``code``."""
        self._lines.write({EVENT: "end", TIME: at, "code": code})

    def close(self) -> None:
        self._lines.close()
