"""When each rank's process ended, and how: watched from outside, to the millisecond.

    watch = DeathWatch(on_death=marks.add)   # told of each death from the watch's thread
    watch.watch(pid=4711, rank=3)      # each poll, for every pid the heartbeats name
    watch.deaths()                     # {pid: Death(rank, pid, at, status)} first seen gone
    watch.close()

Which rank died first decides a crash's culprit, and the ranks of a job die within milliseconds
of each other (the launcher stops the rest the moment one fails; a peer's collective fails at
once). A poll of ``/proc`` every ``poll_s`` would mix them up, so a thread waits on a pidfd per
rank (Linux 5.3: readable the instant the process exits, whoever its parent is) and reads the
zombie's exit status from ``/proc/<pid>/stat`` before its parent reaps it. Where pidfds are not
available the same thread polls ``/proc`` every ``FALLBACK_POLL_S``.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .rank_probe import exit_status, proc_state

FALLBACK_POLL_S = 0.02
"""How often the watcher looks at ``/proc`` when it cannot wait on pidfds (and how long it waits
on them before looking at newly added pids)."""


@dataclass(frozen=True)
class Death:
    """One rank's process, first seen gone."""

    rank: int | None
    pid: int
    at: float
    """Unix seconds it was first seen gone."""
    status: int | None
    """Its exit status (>= 0) or minus its signal; None when its parent reaped it unseen."""


class DeathWatch:
    """Watches the ranks' pids from a daemon thread.

    Args:
        clock: unix seconds (when a death was seen).
        on_death: called with (pid, rank, status) of each death, once, from the watch's thread
            the moment it is seen (it must not block: ``DeathMarks.add`` queues).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        on_death: Callable[[int, int | None, int | None], None] | None = None,
    ) -> None:
        self._clock, self._on_death = clock, on_death
        self._lock = threading.Lock()
        self._ranks: dict[int, int | None] = {}
        """pid -> rank, every pid ever watched."""
        self._fds: dict[int, int] = {}
        """pid -> its pidfd, while it lives (the pids without one are polled)."""
        self._dead: dict[int, Death] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="torchvitals-deaths")
        self._thread.start()

    def watch(self, pid: int, rank: int | None) -> None:
        """Watch ``pid`` (a rank's process) until it ends; a pid already watched is kept."""
        with self._lock:
            if pid in self._ranks:
                if rank is not None and self._ranks[pid] is None:
                    self._ranks[pid] = rank
                return
            self._ranks[pid] = rank
            with contextlib.suppress(OSError, AttributeError):  # gone already, or no pidfds
                self._fds[pid] = os.pidfd_open(pid)
        if pid not in self._fds:
            self._check(pid)

    def deaths(self) -> dict[int, Death]:
        """Every watched pid seen gone so far, by pid."""
        with self._lock:
            return {
                pid: Death(self._ranks.get(pid), pid, d.at, d.status)
                for pid, d in self._dead.items()
            }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        with self._lock:
            for fd in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                fds = {fd: pid for pid, fd in self._fds.items()}
                polled = [p for p in self._ranks if p not in self._fds and p not in self._dead]
            if fds:
                try:
                    ready, _, _ = select.select(list(fds), [], [], FALLBACK_POLL_S)
                except (OSError, ValueError):  # an fd closed by close() meanwhile
                    ready = []
                for fd in ready:
                    self._gone(fds[fd], fd)
            else:
                self._stop.wait(FALLBACK_POLL_S)
            for pid in polled:
                self._check(pid)

    def _gone(self, pid: int, fd: int) -> None:
        """The pidfd of ``pid`` is readable: the process ended (a zombie until reaped)."""
        at, status = self._clock(), exit_status(pid)
        with self._lock:
            if self._fds.pop(pid, None) is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._seen(Death(self._ranks.get(pid), pid, at, status))

    def _check(self, pid: int) -> None:
        state = proc_state(pid)
        if state not in (None, "Z"):
            return
        self._seen(Death(self._ranks.get(pid), pid, self._clock(), exit_status(pid)))

    def _seen(self, death: Death) -> None:
        with self._lock:
            if death.pid in self._dead:
                return
            self._dead[death.pid] = death
        if self._on_death is not None:
            self._on_death(death.pid, death.rank, death.status)
