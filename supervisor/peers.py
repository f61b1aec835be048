"""The seam between a node's supervisor and the job's other nodes: what it asks of them.

    record = peers.join()                     # the job's current attempt
    go = peers.wait_for_peers(record.number)  # StartAttempt(n): every node ready; or JobEnded
    order = peers.watch(go.attempt, step)     # each poll: None, JobRestarted, NodesLost or JobEnded
    settled = peers.settle(attempt, mine, decide)   # a hang or a crash: decided once, for all
    peers.wanted(attempt)                     # each poll: the incidents others want findings for
    peers.asked(attempt)                      # every incident any node asked about
    peers.mark_death(attempt, pid, rank, 13)  # a rank's death, seen now: its store revision
    peers.restart(next_record)                # a restart here is a restart of the job everywhere

One node, no store: ``SoloPeers`` (nothing to agree on). Several: ``StorePeers``
(``store_peers``), agreeing through the job's etcd. What they answer with:
``orders``; what ``decide`` is given: ``Gathered``; what ``settle`` brings back: ``Settled``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..records.incidents import Incident
from .orders import JobEnded, JobRestarted, NodesLost, StartAttempt
from .rank_findings import NodeFindings
from .store_schema import JobAttempt, NodeState


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
class Settled:
    """The incidents the nodes decided on for one disruption."""

    incidents: list[Incident]
    """As their records hold them; the first is the disruption's."""
    by: int
    """The node that gathered the findings and decided (this one, or the first to claim)."""


Decide = Callable[[Gathered], list[Incident]]
"""Every node's findings to the incidents they make (their records written)."""


class Peers(Protocol):
    """What the supervisor asks of the other nodes' supervisors."""

    def join(self) -> JobAttempt: ...

    def current(self) -> JobAttempt: ...

    def wait_for_peers(self, attempt: int) -> StartAttempt | JobEnded: ...

    def started(self, attempt: int) -> None: ...

    def watch(self, attempt: int, step: int) -> JobRestarted | NodesLost | JobEnded | None: ...

    def restart(self, record: JobAttempt) -> JobAttempt: ...

    def settle(
        self, attempt: int, mine: NodeFindings, decide: Decide, *, until_lost: bool = False
    ) -> Settled: ...

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

    def settle(
        self, attempt: int, mine: NodeFindings, decide: Decide, *, until_lost: bool = False
    ) -> Settled:
        return Settled(decide(Gathered([mine])), mine.node)

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
