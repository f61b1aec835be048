"""The run's event log: one JSON object per line, one line per logged step report.

Written by global rank 0 under ``<log_dir>/<run_name>/``; to follow a run:
``tail -f torchvitals_runs/<run>/events.jsonl``
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..jsonsafe import json_safe
from ..report import Action, Report


class EventLog:
    """Appends step reports to a JSON-lines file, flushing each line.

    Args:
        path: the file; missing parent folders are created, an existing file is appended to.
        every: write every this many steps. Skipped steps, steps with a NaN/Inf and steps with
            a verdict are always written.
    """

    def __init__(self, path: str | os.PathLike, *, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.path = Path(path)
        self.every = every
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Held open across writes (line-buffered); close() and the context manager close it.
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, report: Report) -> bool:
        """Append the report if it is due.

        Args:
            report: the step's report.

        Returns:
            Whether a line was written.
        """
        due = (
            report.step % self.every == 0
            or report.action != Action.STEP
            or report.nonfinite
            or bool(report.verdicts)
        )
        if not due:
            return False
        self.write_event({"event": "step", **report.to_dict()})
        return True

    def write_event(self, event: dict[str, Any]) -> None:
        """Append one event (a step report, a validation loss, ...) as a line, flushed.

        Args:
            event: a JSON-serialisable dict with an "event" key naming its kind.
        """
        # default=str: an odd object in a verdict must not stop training over a log line.
        self._file.write(json.dumps(json_safe(event), default=str) + "\n")
        # A crash right after this step must still find its line: flush to the OS (no fsync,
        # which costs milliseconds on network filesystems; the OS outlives the process).
        self._file.flush()

    def close(self) -> None:
        """Close the file; safe to call twice."""
        self._file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read an event log back; non-finite floats stay the strings "nan", "inf", "-inf".

    Args:
        path: the event log.

    Returns:
        One dict per line, in order. A last line cut short by a crash mid-write is dropped.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    events = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break
            raise
    return events
