"""What this node's supervisor sees of one attempt's ranks, kept from its start to its end.

    witness = Witness(folder, node=0, host="h", stderr=proc.stderr, probe_wait_s=2.0,
                      mark=partial(peers.mark_death, attempt))
    witness.poll(beats)                  # each poll: watch every pid the heartbeats name
    witness.deaths()                     # RankDeath per rank seen gone (when, how, its revision)
    witness.findings("hang-a0002")       # NodeFindings: states and stacks, or deaths for a crash
    witness.close(timeout_s=1.0)

The ranks' deaths are watched from the start (``deaths``: to the millisecond, with the exit
status the kernel keeps for a zombie) and each is recorded in the job's store the moment it is
seen (``death_marks``: the store's revision is its place among every node's deaths); the
launcher's stderr is read for its own reports (``launcher_log``: torchrun's ``failed (exitcode:
13) ... (pid: P)``), which fill in a status the kernel no longer had, and a worker that died
before its first heartbeat. A pid is mapped to its global rank through the heartbeats.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import IO

from ..protocol import RankBeat
from ..records.vocabulary import CRASH
from .death_marks import DeathMarks, Mark
from .deaths import DeathWatch
from .launcher_log import LauncherLog, WorkerFailure
from .rank_findings import NodeFindings, RankDeath
from .rank_probe import probe_ranks

MARKS_WAIT_S = 2.0
"""Longest wait for this node's deaths to be recorded in the store before its crash findings go
out (a death left unrecorded comes after every recorded one)."""


def _unrecorded(pid: int, rank: int | None, status: int | None) -> int | None:
    """One node alone: no store, no revision (its own clock orders its deaths)."""
    return None


class Witness:
    """One attempt's ranks, as this node sees them.

    Args:
        folder: the attempt's heartbeat folder.
        node, host: this node (named in every finding).
        stderr: the read end of the launcher's stderr (None: not read).
        probe_wait_s: the wait for a rank's stack.
        mark: records a death in the job's store (default: none, one node alone).
        wall: unix seconds.
        clock: monotonic seconds (the moment the heartbeat ages are taken).
    """

    def __init__(
        self,
        folder: Path,
        *,
        node: int,
        host: str,
        stderr: IO[bytes] | None,
        probe_wait_s: float,
        mark: Mark = _unrecorded,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.folder, self.node, self.host, self.probe_wait_s = folder, node, host, probe_wait_s
        self.ranks: dict[int, int] = {}
        """pid -> global rank, every pid a heartbeat of this attempt named."""
        self._wall, self._clock = wall, clock
        self._marks = DeathMarks(mark)
        self._watch = DeathWatch(wall, on_death=self._marks.add)
        self._log = None if stderr is None else LauncherLog(stderr)

    def poll(self, beats: dict[int, RankBeat]) -> None:
        """Watch the pids the heartbeats name now; record the deaths only the launcher reported."""
        for rank, beat in beats.items():
            if self.ranks.get(beat.pid) != rank:
                self.ranks[beat.pid] = rank
                self._watch.watch(beat.pid, rank)
        self._mark_reported()

    def _mark_reported(self) -> None:
        """Record the workers the launcher reported dead that no heartbeat named (the watch
        records the others the moment they die)."""
        for pid, failure in self.failures().items():
            if pid not in self.ranks:
                self._marks.add(pid, failure.rank, failure.exitcode)

    def failures(self) -> dict[int, WorkerFailure]:
        """The launcher's reports of failed workers so far, by pid."""
        return {} if self._log is None else self._log.failures()

    def deaths(self, revisions: dict[int, int] | None = None) -> tuple[RankDeath, ...]:
        """Every rank seen gone, and every worker the launcher reported failed, first first (by
        this node's clock), each with the revision of its record in the store so far
        (``revisions``: those to use)."""
        failures = self.failures()
        revisions = self._marks.known() if revisions is None else revisions
        found = {}
        for pid, death in self._watch.deaths().items():
            failure = failures.get(pid)
            status = death.status
            if status is None and failure is not None:
                status = failure.exitcode
            found[pid] = RankDeath(
                rank=self.ranks.get(pid, death.rank),
                node=self.node,
                host=self.host,
                pid=pid,
                at=death.at,
                status=status,
                line=failure.line if failure is not None else "",
                revision=revisions.get(pid),
            )
        for pid, failure in failures.items():
            if pid in found:
                if found[pid].rank is None and failure.rank is not None:
                    found[pid] = replace(found[pid], rank=failure.rank)
                continue
            # A worker no heartbeat named (it died before writing one): known from the report.
            found[pid] = RankDeath(
                rank=self.ranks.get(pid, failure.rank),
                node=self.node,
                host=self.host,
                pid=pid,
                at=failure.seen_at,
                status=failure.exitcode,
                line=failure.line,
                revision=revisions.get(pid),
            )
        return tuple(sorted(found.values(), key=lambda d: (d.at, d.pid)))

    def findings(self, key: str) -> NodeFindings:
        """This node's findings for incident ``key``: its ranks' deaths for a crash, their
        states and stacks (taken now) for a hang."""
        if key.startswith(CRASH + "-"):
            self._mark_reported()
            revisions = self._marks.revisions(MARKS_WAIT_S)
            deaths = self.deaths(revisions)
            return NodeFindings(node=self.node, host=self.host, key=key, deaths=deaths)
        taken = self._clock()  # the ages' moment: the probe reads the heartbeats first
        ranks = probe_ranks(
            self.folder, node=self.node, host=self.host, wait_s=self.probe_wait_s, wall=self._wall
        )
        return NodeFindings(node=self.node, host=self.host, key=key, ranks=ranks, taken_at=taken)

    def close(self, timeout_s: float) -> None:
        """Stop watching; wait up to ``timeout_s`` for the launcher's last words."""
        self._watch.close()
        if self._log is not None:
            self._log.close(timeout_s)
