"""A per-rank heartbeat file, read from outside the process by the supervisor.

    TORCHVITALS_HEARTBEAT_DIR=/tmp/job/heartbeat torchrun ... train.py

Each rank replaces ``heartbeat-rank<r>.json`` ({"step", "time", "phase", "pid", "rank"}) at most
once per ``interval_s`` while training, and at once when the phase changes ("checkpoint" while a
checkpoint is written or loaded, so a long save is not taken for a hang). A stopped or stuck
rank stops beating; nothing in the process has to run for the supervisor to notice.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable



class Heartbeat:
    """Args:
        folder: where the rank's heartbeat file lives (created when missing).
        rank: this process's global rank.
        interval_s: the least time between two writes in the same phase.
    """

    def __init__(self, folder: str | os.PathLike, rank: int, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.time):
        self.path = Path(folder) / f"heartbeat-rank{rank:05d}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.interval_s, self._clock = rank, interval_s, clock
        self.step, self.phase, self._last = 0, "train", -float("inf")

    def beat(self, step: int | None = None, phase: str | None = None) -> None:
        """Record progress; writes when the phase changed or ``interval_s`` passed."""
        now = self._clock()
        changed = phase is not None and phase != self.phase
        self.step = self.step if step is None else step
        self.phase = self.phase if phase is None else phase
        if changed or now - self._last >= self.interval_s:
            tmp = self.path.with_name(self.path.name + ".tmp")
            # No fsync: the reader is on this host and a crash of the host ends the job anyway.
            tmp.write_text(f'{{"step": {self.step}, "time": {now}, "phase": "{self.phase}", '
                           f'"pid": {os.getpid()}, "rank": {self.rank}}}')
            os.replace(tmp, self.path)
            self._last = now
