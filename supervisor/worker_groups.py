"""The groups of workers torchrun runs within one attempt, told from the heartbeats alone.

    groups = WorkerGroups()
    started_at, dead = groups.follow(read_rank_beats(folder))   # each poll
    groups.generation      # torchrun's restarts of the workers so far (the incidents' keys)
    failed(witness, beats) # whether a dead group failed, or finished

torchrun (``--max-restarts``) restarts its workers inside one attempt: the ranks' pids all vanish
while the launcher runs, and new pids write the same ranks' heartbeat files. Each group is one
generation: a crash or a hang of the workers of torchrun's n-th restart is keyed ``-r<n>``, the
same on every node (each counts its own groups). The first heartbeat of a new group is the job
training again.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from ..protocol import RankBeat
from .process import running
from .witness import Witness


class WorkerGroups:
    """The worker groups of one attempt.

    Args:
        alive: whether a pid runs (default: ``/proc`` says so, zombies not).
        wall: unix seconds.
    """

    def __init__(
        self,
        alive: Callable[[int], bool] = running,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._alive, self._wall = alive, wall
        self.pids: set[int] = set()
        """Every pid a heartbeat of this attempt named."""
        self.by_rank: dict[int, int] = {}
        """Each rank's pid as last seen."""
        self.group: set[int] = set()
        """The pids of the current group."""
        self.generation = 0
        """Worker groups torchrun restarted before the current one."""
        self.dead_at: float | None = None
        """Unix seconds every rank of the current group was seen gone (the launcher alive)."""
        self.crashed: set[int] = set()
        """Generations whose crash was localized (once each)."""
        self.judged: set[int] = set()
        """Dead generations told a crash or not while the launcher went on."""

    @property
    def current(self) -> int:
        """The generation running, or starting after a dead one."""
        return self.generation + (self.dead_at is not None)

    def follow(self, beats: dict[int, RankBeat]) -> tuple[float | None, bool]:
        """One look at the heartbeats.

        Returns:
            (started_at, dead): the heartbeat time of pids seen for the first time (a group
            started: the attempt's first, or torchrun's restart), else None; whether every rank
            of the heartbeats is gone.
        """
        pids = {b.pid for b in beats.values()}
        new = pids - self.pids
        started_at = None
        if new:
            # A rank of the current group under a new pid is a new group even if the old one
            # was never seen all gone: the nodes of a job count torchrun's restarts alike (the
            # incidents' keys). The new group's ranks come one by one: one group.
            replaced = any(
                self.by_rank.get(r) in self.group for r, b in beats.items() if b.pid in new
            )
            if self.dead_at is not None or replaced:
                self.generation += 1
                self.dead_at = None
                self.group = set()
            self.group |= new
            self.pids |= new
            started_at = min(b.time for b in beats.values() if b.pid in new)
        self.by_rank.update({r: b.pid for r, b in beats.items()})
        dead = bool(pids) and not any(map(self._alive, pids))
        if dead and self.dead_at is None:
            self.dead_at = self._wall()
        return started_at, dead


def failed(witness: Witness, beats: dict[int, RankBeat]) -> bool:
    """Whether a rank of ``beats`` failed: the launcher reported it, or it ended by a signal or
    a non-zero status. Not: ranks that all exited 0 (they finished: the launcher is about to
    exit 0), nor ranks all stopped by SIGTERM (torchrun restarting its workers for a change of
    membership, or after another node's worker failed, which that node names)."""
    pids = {b.pid for b in beats.values()}
    if pids & set(witness.failures()):
        return True
    return any(
        d.status not in (None, 0, -signal.SIGTERM) for d in witness.deaths() if d.pid in pids
    )
