"""A per-rank heartbeat file, read from outside the process by the supervisor.

    TORCHVITALS_HEARTBEAT_DIR=/tmp/job/heartbeat torchrun ... train.py

Each rank replaces its heartbeat file (the format and the phases: ``torchvitals.protocol``) at
most once per ``interval_s`` while training, and at once when the phase changes (CHECKPOINT
while a checkpoint is written or loaded, so a long save is not taken for a hang; ABORTED when
the job gives up on purpose). A stopped or stuck rank stops beating; nothing in the process has
to run for the supervisor to notice.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ...protocol import TRAIN, heartbeat_path, write_heartbeat

log = logging.getLogger(__name__)


class Heartbeat:
    """Args:
    folder: where the rank's heartbeat file lives (created when missing).
    rank: this process's global rank.
    interval_s: the least time between two writes in the same phase.
    clock: wall-clock seconds, written into the file.
    flush: write a step that ``interval_s`` held back once ``interval_s`` has passed, from a
        timer thread, so a job that hangs right after it still shows the step it reached (a
        hang incident names it). Off by default: a test's fake clock sees no thread write.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        rank: int,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        flush: bool = False,
    ):
        self.path = heartbeat_path(folder, rank)
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.rank, self.interval_s, self._clock = rank, interval_s, clock
        self.step, self.phase, self._last = 0, TRAIN, -float("inf")
        self.metrics_url: str | None = None
        """Where this rank's /metrics serves, written into every beat (set once it is known)."""
        self.stack_signal: int | None = None
        """The signal on which this rank writes its stacks (``stacks.py``), written into every
        beat; None: none registered."""
        self._failed = False
        self._flush, self._closed = flush, False
        self._written: tuple[int, str] | None = None
        """The step and phase of the last write (a held-back step differs)."""
        self._reached = -float("inf")
        """When the current step and phase were reached: the time a flushed beat carries, so
        the supervisor's hang clock counts from the progress, not from the flush up to
        ``interval_s`` later."""
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        """One writer at a time: the step and the flush timer share the temporary file."""

    def forget_stacks(self) -> None:
        """The stack signal is no longer registered (``agent.close()``): say so at once, so a
        supervisor never sends a signal whose default action would end the process."""
        if self.stack_signal is not None:
            self.stack_signal = None
            self.beat(force=True)

    def beat(self, step: int | None = None, phase: str | None = None, force: bool = False) -> None:
        """Record progress; writes when the phase changed, ``interval_s`` passed, or ``force``."""
        with self._lock:
            now = self._clock()
            changed = force or (phase is not None and phase != self.phase)
            if changed or (step is not None and step != self.step):
                self._reached = now
            self.step = self.step if step is None else step
            self.phase = self.phase if phase is None else phase
            if changed or now - self._last >= self.interval_s:
                self._write(now)
            elif self._flush and self._timer is None and not self._closed:
                # One timer at most per interval: a thread started about once a second.
                self._timer = threading.Timer(self.interval_s, self._flush_held)
                self._timer.daemon = True
                self._timer.start()

    def close(self) -> None:
        """No more writes from the flush timer (``agent.close()``)."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _flush_held(self) -> None:
        with self._lock:
            self._timer = None
            if not self._closed and self._written != (self.step, self.phase):
                self._write(self._clock(), at=self._reached)

    def _write(self, now: float, at: float | None = None) -> None:
        """Write the beat at ``now``; ``at``: the progress time it carries (default ``now``)."""
        try:
            write_heartbeat(
                self.path,
                step=self.step,
                time=now if at is None else at,
                phase=self.phase,
                pid=os.getpid(),
                rank=self.rank,
                metrics_url=self.metrics_url,
                stack_signal=self.stack_signal,
            )
        except OSError as exc:
            # A full or vanished folder must not stop the training it reports on; the
            # supervisor sees the beats stop and acts on that.
            if not self._failed:
                log.warning(
                    "torchvitals: cannot write the heartbeat %s (%s); the training goes on",
                    self.path,
                    exc,
                )
            self._failed = True
            return
        self._failed = False
        self._last = now
        self._written = (self.step, self.phase)
