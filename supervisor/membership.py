"""Which nodes a job runs on, which of them are alive, and how a lost one is named.

    members = Membership(JobStore(store, "4711"), node=0, nnodes=2, metrics=metrics)
    nodes = members.nodes()               # {rank: NodeState} alive or done; updates the metrics
    members.ready(attempt)                # the ranks at the barrier of ``attempt`` or running it
    members.lost(nodes, attempt)          # the members missing from ``nodes``, as last seen

A node is alive while its record's lease holds; a node that is gone is named by the last state
it published (``node 1 (host h, supervisor pid p) lost at step 57``), and when that step was
first seen (a node publishes its step at most once per lease renewal, so it lags).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .job_store import JobStore
from .store_schema import RUNNING, WAITING, NodeState
from .telemetry import SupervisorMetrics


class Membership:
    """The nodes of one job, as this node's supervisor sees them.

    Args:
        keys: the job's keys.
        node: this node's rank (it publishes its own presence only).
        nnodes: the nodes the job starts with.
        metrics: where the nodes present and expected are shown.
    """

    def __init__(
        self,
        keys: JobStore,
        *,
        node: int,
        nnodes: int,
        metrics: SupervisorMetrics,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.keys, self.node, self.metrics, self._wall = keys, node, metrics, wall
        self.members: set[int] = set(range(nnodes))
        """The node ranks the job runs on (fewer than ``nnodes`` after it went on without a lost
        node, ``min_nodes`` allowing)."""
        self.seen: dict[int, NodeState] = {}
        """The last state each node published (to name a lost one with its host and step)."""
        self.alive: dict[int, NodeState] = {}
        """The nodes present at the last ``ready``."""
        self.published_at: dict[int, float] = {}
        """When each node's last published step (its attempt and step) was first seen (unix
        seconds)."""

    def nodes(self) -> dict[int, NodeState]:
        """The nodes alive (their lease held) or done, by node rank, as the store has them now;
        updates the metrics."""
        nodes = self.keys.nodes()
        now = self._wall()
        for state in nodes.values():
            self._saw(state, now)
        self.present(nodes)
        return nodes

    def present(self, nodes: dict[int, NodeState]) -> None:
        """Show the nodes present (``nodes``: alive or done) in the metrics."""
        # Each node publishes its own presence only: O(nodes) series for the job, not O(nodes^2).
        self.metrics.node_present.labels(str(self.node)).set(1 if self.node in nodes else 0)
        self.metrics.nodes_present.set(len(nodes))
        self.metrics.nodes_expected.set(len(self.members))

    def _saw(self, state: NodeState, at: float | None) -> None:
        """``state`` is node ``state.node``'s record as of ``at`` (None: not known when)."""
        before = self.seen.get(state.node)
        if before is None or (before.attempt, before.step) != (state.attempt, state.step):
            if at is None:
                self.published_at.pop(state.node, None)
            else:
                self.published_at[state.node] = at
        if state.pid:
            self.seen[state.node] = state

    def ready(self, attempt: int) -> set[int]:
        """The nodes at the barrier of ``attempt`` or running it."""
        self.alive = self.nodes()
        return {
            n
            for n, s in self.alive.items()
            if s.attempt == attempt and s.state in (WAITING, RUNNING)
        }

    def lost(self, nodes: dict[int, NodeState], attempt: int) -> tuple[NodeState, ...]:
        """The members missing from ``nodes`` (a key present is a node alive or done), each as
        it was last seen: by the store's watch when its key went (its last record), else by the
        last read."""
        missing = self.members - set(nodes)
        if missing:
            for n, (state, at) in self.keys.departed().items():
                if n in missing:
                    self._saw(state, at)
        return tuple(
            self.seen.get(n, NodeState(n, "?", 0, attempt, WAITING))
            for n in sorted(self.members)
            if n not in nodes
        )

    def gone(self, ready: set[int]) -> list[int]:
        """Nodes seen once that are neither ready nor alive now (oldest rank first)."""
        return sorted(set(self.seen) - ready - set(self.alive))

    def describe(self, node: int) -> str:
        """A lost node, as a person reads it: its host, pid and last step."""
        seen = self.seen.get(node)
        if seen is None:
            return f"node {node} never joined"
        return f"{seen.name()} lost at step {seen.step}"
