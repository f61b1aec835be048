"""What a node's supervisor asks of the job's other nodes, and the orders they answer with.

    record = peers.join()                     # the job's current attempt
    go = peers.wait_for_peers(record.number)  # StartAttempt(n): every node ready; or JobEnded
    order = peers.watch(go.attempt, step)     # each poll: None, JobRestarted, NodesLost or JobEnded
    every = peers.gather(attempt, mine)       # a hang or a crash: every node's findings
    peers.wanted(attempt)                     # each poll: the incidents others want findings for
    peers.asked(attempt)                      # every incident any node asked about
    peers.mark_death(attempt, pid, rank, 13)  # a rank's death, seen now: its store revision
    peers.restart(next_record)                # a restart here is a restart of the job everywhere

One node, no store: ``SoloPeers`` (nothing to agree on). Several: ``StorePeers``
(``store_peers``), agreeing through the job's etcd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .findings import NodeFindings
from .job_records import JobAttempt, NodeState


@dataclass(frozen=True)
class StartAttempt:
    """Every node is ready: start ``attempt`` (a later one when the job moved on meanwhile)."""

    attempt: int


@dataclass(frozen=True)
class JobRestarted:
    """Another node restarted the job into ``attempt``: stop this node's launcher and follow."""

    attempt: int
    reason: str = ""
    """Why that node restarted it (a person reads it)."""


@dataclass(frozen=True)
class NodesLost:
    """Nodes of the job stopped renewing their leases: stop, and restart without (or with a
    replacement for) them."""

    lost: tuple[NodeState, ...]
    """Their last published state (host, pid, step)."""
    reason: str
    """``node 1 (host h, supervisor pid p) lost at step 57 (...)``, one per lost node."""
    step: int | None = None
    """The step this node's ranks had reached when the loss was seen: in synchronous training
    the step the lost node reached too (what it published lags by up to a lease renewal)."""
    published_at: tuple[float | None, ...] = ()
    """For each of ``lost``: when its published step was first seen (unix seconds; None:
    never)."""


@dataclass(frozen=True)
class Gathered:
    """Every node's findings about one incident, as far as they came."""

    findings: list[NodeFindings]
    """By node, this node's included."""
    lost: tuple[NodeState, ...] = ()
    """Nodes that never answered because they are gone (their lease expired meanwhile), as
    last seen: the incident is their loss."""
    published_at: tuple[float | None, ...] = ()
    """For each of ``lost``: when its last published step was first seen (unix seconds)."""


@dataclass(frozen=True)
class JobEnded:
    """The job ended for good (on any node's word): exit with ``code``, never restart."""

    code: int
    reason: str = ""


Order = StartAttempt | JobRestarted | NodesLost | JobEnded
"""What the job asks of this node: ``wait_for_peers`` answers StartAttempt or JobEnded,
``watch`` JobRestarted, NodesLost or JobEnded (or None: go on)."""


class Peers(Protocol):
    """What the supervisor asks of the other nodes' supervisors."""

    def join(self) -> JobAttempt: ...

    def current(self) -> JobAttempt: ...

    def wait_for_peers(self, attempt: int) -> StartAttempt | JobEnded: ...

    def started(self, attempt: int) -> None: ...

    def watch(self, attempt: int, step: int) -> JobRestarted | NodesLost | JobEnded | None: ...

    def restart(self, record: JobAttempt) -> JobAttempt: ...

    def gather(self, attempt: int, mine: NodeFindings, *, until_lost: bool = False) -> Gathered: ...

    def wanted(self, attempt: int, *, now: bool = False) -> tuple[str, ...]: ...

    def asked(self, attempt: int) -> frozenset[str]: ...

    def answer(self, attempt: int, mine: NodeFindings) -> None: ...

    def mark_death(
        self, attempt: int, pid: int, rank: int | None, status: int | None
    ) -> int | None: ...

    def finish(self, code: int, reason: str) -> int: ...

    def done(self) -> None: ...

    def close(self) -> None: ...


class SoloPeers:
    """One node: its supervisor alone decides; nothing is published."""

    def __init__(self) -> None:
        self._record = JobAttempt()

    def join(self) -> JobAttempt:
        return self._record

    def current(self) -> JobAttempt:
        return self._record

    def wait_for_peers(self, attempt: int) -> StartAttempt | JobEnded:
        return StartAttempt(attempt)

    def started(self, attempt: int) -> None:
        pass

    def watch(self, attempt: int, step: int) -> JobRestarted | NodesLost | JobEnded | None:
        return None

    def restart(self, record: JobAttempt) -> JobAttempt:
        self._record = record
        return record

    def gather(self, attempt: int, mine: NodeFindings, *, until_lost: bool = False) -> Gathered:
        return Gathered([mine])

    def wanted(self, attempt: int, *, now: bool = False) -> tuple[str, ...]:
        return ()

    def asked(self, attempt: int) -> frozenset[str]:
        return frozenset()

    def answer(self, attempt: int, mine: NodeFindings) -> None:
        pass

    def mark_death(self, attempt: int, pid: int, rank: int | None, status: int | None) -> None:
        return None  # one node: its own clock orders its deaths

    def finish(self, code: int, reason: str) -> int:
        return code

    def done(self) -> None:
        pass

    def close(self) -> None:
        pass
