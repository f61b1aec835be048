"""Each rank death this node sees, recorded in the job's store the moment it is seen: the store's
revisions put the deaths of every node in one order, which the hosts' clocks cannot.

    marks = DeathMarks(lambda pid, rank, status: peers.mark_death(attempt, pid, rank, status))
    marks.add(pid, rank, status)      # from the death watch's thread: queued, never blocks it
    marks.revisions(wait_s=2.0)       # {pid: revision}, once the queued ones are written

Which rank died first across nodes names a crash's culprit, and two nodes' deaths are often
milliseconds apart while their hosts' clocks may be seconds or minutes apart: no unix time of
one host may be compared with another's. Every write to the store has a revision, one order for
all writers, so each death is written the moment its node sees it, and the revision of that
write is its place among every node's deaths. A death's cross-node order is then off by at most
the two nodes' delays from the exit to the write (a thread woken by a pidfd, one request to the
store), never by their clocks. The writes run on a thread of their own: a slow store never holds
up the watch that times the next death.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("torchvitals.supervisor")

Mark = Callable[[int, int | None, int | None], int | None]
"""Records one death (pid, rank, status) in the store; returns the revision of the write (None:
not recorded: one node alone, or the store did not answer)."""


class DeathMarks:
    """The deaths of one attempt's ranks on this node, recorded one by one in the job's store,
    in the order they were seen, by a thread that runs while some are left to write.

    Args:
        mark: records one death; called from this object's thread only.
        clock: monotonic seconds (the bound of ``revisions``).
    """

    def __init__(self, mark: Mark, clock: Callable[[], float] = time.monotonic) -> None:
        self._mark, self._clock = mark, clock
        self._lock = threading.Condition()
        self._todo: deque[tuple[int, int | None, int | None]] = deque()
        self._added: set[int] = set()
        self._revisions: dict[int, int | None] = {}
        """pid -> the revision of its record, for every death written or given up on."""
        self._busy = False
        """Whether a thread is writing (it ends once nothing is left: nothing to close)."""

    def add(self, pid: int, rank: int | None, status: int | None) -> None:
        """Record the death of ``pid`` (once: a pid added again is ignored); never blocks."""
        with self._lock:
            if pid in self._added:
                return
            self._added.add(pid)
            self._todo.append((pid, rank, status))
            if self._busy:
                return
            self._busy = True
        threading.Thread(target=self._run, daemon=True, name="torchvitals-death-marks").start()

    def revisions(self, wait_s: float) -> dict[int, int]:
        """The revision of every death recorded, by pid, once every death added so far has been
        written (waiting up to ``wait_s``: a store that does not answer leaves the rest out)."""
        deadline = self._clock() + wait_s
        with self._lock:
            while len(self._revisions) < len(self._added):
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._lock.wait(min(left, 0.05))
            return {pid: r for pid, r in self._revisions.items() if r is not None}

    def known(self) -> dict[int, int]:
        """The revisions written so far, by pid (no wait)."""
        with self._lock:
            return {pid: r for pid, r in self._revisions.items() if r is not None}

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._todo:
                    self._busy = False
                    return
                pid, rank, status = self._todo.popleft()
            try:
                revision = self._mark(pid, rank, status)
            except Exception as exc:  # the supervisor goes on without this death's order
                log.warning(
                    "torchvitals supervise: cannot record the death of pid %d: %s", pid, exc
                )
                revision = None
            with self._lock:
                self._revisions[pid] = revision
                self._lock.notify_all()
