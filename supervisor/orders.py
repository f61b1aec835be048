"""What the job's other nodes tell a node's supervisor to do: one frozen class per order.

    go = peers.wait_for_peers(attempt)   # StartAttempt(n): every node ready; or JobEnded
    order = peers.watch(attempt, step)   # each poll: None, JobRestarted, NodesLost or JobEnded
    match order:
        case JobRestarted(attempt=n): ...   # another node restarted the job: follow it into n
        case NodesLost(lost=nodes): ...     # nodes stopped renewing their leases
        case JobEnded(code=code): ...       # the job ended for good: exit with ``code``

Who asks and who answers: ``peers`` (``Peers``; ``SoloPeers`` on one node, ``StorePeers`` through
the job's etcd on several). Plain data: the outcomes of an attempt and the restart policy read
them without the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from .store_schema import NodeState


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
class JobEnded:
    """The job ended for good (on any node's word): exit with ``code``, never restart."""

    code: int
    reason: str = ""


Order = StartAttempt | JobRestarted | NodesLost | JobEnded
"""What the job asks of this node: ``wait_for_peers`` answers StartAttempt or JobEnded,
``watch`` JobRestarted, NodesLost or JobEnded (or None: go on)."""
