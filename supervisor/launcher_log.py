"""The launcher's stderr, passed through unchanged, read for its reports of dead workers.

    log = LauncherLog(proc.stderr)     # Popen(..., stderr=PIPE): every byte goes on to our stderr
    log.failures()                     # {pid: WorkerFailure(exitcode, local_rank, pid, rank, line)}
    log.close(timeout_s=1.0)           # after the launcher exited: the rest is copied out

torchrun's elastic agent says which worker failed first, with its exit status, on its stderr:

    E1202 14:06:31.787000 5526 .../multiprocessing/api.py:1002] failed (exitcode: 13) \
local_rank: 1 (pid: 5572) of binary: /usr/bin/python3

and, when it gives up, a summary whose "Root Cause" names the global rank too
(``rank : 1 (local_rank: 1)`` then ``exitcode : 13 (pid: 5572)``). Both are read here (the
formats of torch 2.x's ``torch.distributed.elastic.multiprocessing.api`` and ``errors``).

The copy is a daemon thread that writes every byte it reads to this process's stderr at once,
unbuffered and unchanged (the user sees all of it, colours and carriage returns included); it
reads until the launcher and its workers close the pipe, so a supervisor that is stopping still
passes on their last words. Matching works on a bounded line buffer and never holds the copy up.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import IO

LINE_MAX_BYTES = 64 * 1024
"""A line longer than this is passed on but not matched (a progress bar without newlines)."""

FAILED = re.compile(
    r"failed \(exitcode: (?P<exitcode>-?\d+)\) local_rank: (?P<local_rank>\d+) "
    r"\(pid: (?P<pid>\d+)\) of (?:binary|fn)"
)
ROOT_RANK = re.compile(r"^\s*rank\s*: (?P<rank>\d+) \(local_rank: (?P<local_rank>\d+)\)")
ROOT_EXIT = re.compile(r"^\s*exitcode\s*: (?P<exitcode>-?\d+) \(pid: (?P<pid>\d+)\)")


@dataclass(frozen=True)
class WorkerFailure:
    """A worker the launcher reported dead."""

    exitcode: int
    """Its exit status, or minus the signal that killed it (torchrun's convention)."""
    local_rank: int
    pid: int
    rank: int | None = None
    """Its global rank (the root-cause summary names it; the log line does not)."""
    line: str = ""
    """The launcher's line, as it wrote it."""
    seen_at: float = 0.0
    """Unix seconds the line was read."""


class FailureLines:
    """Reads launcher lines one at a time; remembers each failure by pid."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.failures: dict[int, WorkerFailure] = {}
        self._root = False
        self._rank: tuple[int, int] | None = None

    def feed(self, line: str) -> WorkerFailure | None:
        """One line (without its newline); returns the failure it reports, if any."""
        if not self._root and "exitcode" not in line and "Root Cause" not in line:
            return None  # nearly every line: the training's own output
        match = FAILED.search(line)
        if match:
            found = WorkerFailure(
                int(match["exitcode"]),
                int(match["local_rank"]),
                int(match["pid"]),
                line=line.strip(),
                seen_at=self._clock(),
            )
            return self._keep(found)
        if "Root Cause" in line:
            self._root, self._rank = True, None
            return None
        if not self._root:
            return None
        match = ROOT_RANK.match(line)
        if match:
            self._rank = (int(match["rank"]), int(match["local_rank"]))
            return None
        match = ROOT_EXIT.match(line)
        if match and self._rank is not None:
            rank, local_rank = self._rank
            self._root, self._rank = False, None
            return self._keep(
                WorkerFailure(
                    int(match["exitcode"]),
                    local_rank,
                    int(match["pid"]),
                    rank,
                    line.strip(),
                    self._clock(),
                )
            )
        return None

    def _keep(self, found: WorkerFailure) -> WorkerFailure:
        known = self.failures.get(found.pid)
        if known is not None:  # the log line first, the summary later: keep the line, add the rank
            found = replace(known, rank=found.rank if found.rank is not None else known.rank)
        self.failures[found.pid] = found
        return found


class LauncherLog:
    """Copies ``stream`` (the launcher's stderr pipe) to ``out`` and reads it for failures.

    Args:
        stream: the read end of the launcher's stderr.
        out: where every byte goes on (default: this process's stderr).
    """

    def __init__(self, stream: IO[bytes], out: int | None = None) -> None:
        self._fd = stream.fileno()
        self._stream = stream
        self._out = sys.stderr.fileno() if out is None else out
        self._lines = FailureLines()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, daemon=True, name="torchvitals-stderr")
        self._thread.start()

    def failures(self) -> dict[int, WorkerFailure]:
        """Every worker failure reported so far, by pid."""
        with self._lock:
            return dict(self._lines.failures)

    def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the copy to reach the end of the pipe (the launcher and
        every worker closed it); a copy still running goes on in the background."""
        self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._stream.close()

    def _copy(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:
                return
            if not chunk:
                break
            _write_all(self._out, chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) > LINE_MAX_BYTES:
                pending = b""
            for line in lines:
                if len(line) <= LINE_MAX_BYTES:
                    with self._lock:
                        self._lines.feed(line.decode("utf-8", errors="replace"))
        if pending:
            with self._lock:
                self._lines.feed(pending.decode("utf-8", errors="replace"))


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` (a pipe may take part of it); a closed stderr drops it."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return
        view = view[written:]
