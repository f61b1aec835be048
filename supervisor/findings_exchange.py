"""The nodes' findings about one incident, put together through the job's store.

    exchange = FindingsExchange(keys, membership, config, node=0)
    every = exchange.gather(attempt, mine)     # Gathered: publish, ask the others, wait (bounded)
    for key in exchange.wanted(attempt):       # each poll: what others asked this node
        exchange.answer(attempt, findings_for(key))
    exchange.mark_death(attempt, pid, rank, status)   # a death seen now: its store revision

A node that sees a hang or a crash publishes what it found about its own ranks under the
incident's key (``findings/<node>/a<attempt>/<key>``) and asks every node for theirs
(``wanted/<node>/a<attempt>/<key>``); each node's watch loop looks for such requests at every
store poll and answers with its own ranks, before its launcher is stopped. The node that asked
waits up to ``findings_wait_s`` for every node running the attempt, then decides on what it has
(a node lost or too slow is decided without). Every key lives by its writer's node lease, and a
node removes its own at the start of each attempt: nothing of an old attempt stays.

What the nodes share is the store's order, not their clocks: each rank's death is recorded
(``deaths/<node>/a<attempt>/<pid>``) the moment its node sees it, and the revision of that write
orders it among every node's; a node's heartbeat ages are published as of the moment it asked
(or saw the ask, on its own monotonic clock), so every node's count from one moment to within a
store poll.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from .etcd import StoreError
from .job_store import JobStore, StoreOutage
from .membership import Membership
from .options import SupervisorConfig
from .peers import Gathered
from .rank_findings import NodeFindings
from .store_schema import RUNNING, NodeState

log = logging.getLogger("torchvitals.supervisor")

GATHER_POLL_S = 0.2
"""How often a node waiting for the others' findings looks for them."""


class FindingsExchange:
    """This node's side of the exchange.

    Args:
        keys: the job's keys.
        membership: the job's nodes (who runs the attempt).
        config: ``findings_wait_s``, ``store_poll_s``.
        node: this node's rank.
        outage: logs a blink of the store once.
        clock, sleep: monotonic seconds and the wait between looks.
    """

    def __init__(
        self,
        keys: JobStore,
        membership: Membership,
        config: SupervisorConfig,
        *,
        node: int,
        outage: StoreOutage,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.keys, self.membership, self.config, self.node = keys, membership, config, node
        self._outage, self._clock, self._sleep = outage, clock, sleep
        self._answered: set[tuple[int, str]] = set()
        self._looked = -float("inf")

    def gather(self, attempt: int, mine: NodeFindings, *, until_lost: bool = False) -> Gathered:
        """Publish ``mine``, ask every node for its findings under the same key, and wait up to
        ``findings_wait_s`` for each node running ``attempt``.

        Args:
            attempt: the job's attempt.
            mine: this node's findings (their key is the incident's).
            until_lost: a node still silent after ``findings_wait_s`` is waited for until it
                answers or its lease expires (``node_ttl_s`` more at most): a crash whose ranks
                died of a node's loss (their collectives failed) is that node's loss.

        Returns:
            Every node's findings found (this node's included), and the nodes found lost.
        """
        mine = mine.as_of(self._clock())  # its heartbeat ages count to the ask
        try:
            self._publish(attempt, mine)
            self.keys.want(self.node, attempt, mine.key)
        except StoreError as exc:
            self._outage.failed(exc)
            return Gathered([mine])
        start = self._clock()
        deadline = start + self.config.findings_wait_s
        try:  # who runs the attempt: read once, then only the findings are looked at
            running = set(self._running(attempt))
        except StoreError as exc:
            self._outage.failed(exc)
            running = set()
        found, missing = self._look(attempt, mine.key, running)
        while missing and self._clock() < deadline:
            self._sleep(GATHER_POLL_S)
            found, missing = self._look(attempt, mine.key, running)
        lost: dict[int, NodeState] = {}
        if until_lost:
            # A node gone (its lease expired: before the ask, or since) is the cause; one still
            # silent is lost (its lease runs out within node_ttl_s) or busy (it answers).
            deadline = self._clock() + self.config.node_ttl_s + self.config.store_poll_s
            while True:
                try:
                    alive = self.membership.nodes()  # a key present: alive, or done
                    found = self.keys.findings(attempt, mine.key)
                except StoreError as exc:
                    self._outage.failed(exc)
                    alive = None
                if alive is not None:
                    for state in self.membership.lost(alive, attempt):
                        if state.node not in found:
                            lost[state.node] = state
                    # Still to come: alive, running the attempt, silent.
                    missing = {
                        n
                        for n in missing
                        if n in alive and _runs(alive[n], attempt) and n not in found
                    }
                if not missing or self._clock() >= deadline:
                    break
                self._sleep(GATHER_POLL_S)
        if missing:
            log.warning(
                "torchvitals supervise: %s: no findings from node(s) %s within %.0f s; "
                "deciding without them",
                mine.key,
                ", ".join(map(str, sorted(missing))),
                self._clock() - start,
            )
        out = {self.node: mine}
        for node, text in found.items():
            if node == self.node:
                continue
            try:
                out[node] = NodeFindings.from_json(text)
            except ValueError as exc:
                log.warning("torchvitals supervise: node %d's findings: %s", node, exc)
        gone = tuple(lost[n] for n in sorted(lost))
        return Gathered(
            [out[n] for n in sorted(out)],
            gone,
            tuple(self.membership.published_at.get(s.node) for s in gone),
        )

    def asked(self, attempt: int) -> frozenset[str]:
        """Every incident key of ``attempt`` any node asked findings for."""
        try:
            return frozenset(self.keys.wanted(attempt))
        except StoreError as exc:
            self._outage.failed(exc)
            return frozenset()

    def _look(self, attempt: int, key: str, running: set[int]) -> tuple[dict[int, str], set[int]]:
        """The findings published for ``key``, and the nodes running ``attempt`` that have not
        published theirs (only nodes running it are waited for: one lost or done has none).
        From the job's view while its watches hold (``running``: those running it when the
        ask went out, less any whose lease ran out since), so the nodes that detected the same
        hang together wait on their watches instead of each reading every node's findings
        and records from the store five times a second; else from the store, as it is now.
        ``running`` is narrowed in place."""
        cached = self.keys.view is not None and self.keys.view.live
        try:
            found = self.keys.findings(attempt, key, cached=cached)
            if cached:  # a node whose lease ran out since is no longer waited for
                running &= set(self.keys.nodes(cached=True))
            else:
                running = set(self._running(attempt))
        except StoreError as exc:
            self._outage.failed(exc)
            return {}, set()
        return found, running - set(found) - {self.node}

    def _running(self, attempt: int) -> dict[int, NodeState]:
        return {n: s for n, s in self.membership.nodes().items() if _runs(s, attempt)}

    def wanted(self, attempt: int, *, now: bool = False) -> tuple[str, ...]:
        """The incident keys of ``attempt`` another node asked for and this node has not
        answered: from the job's view while its watches hold (at every call, at no cost to
        the store), else from the store at most every ``store_poll_s`` unless ``now``."""
        at = self._clock()
        cached = not now and self.keys.view is not None and self.keys.view.live
        if not now and not cached and at - self._looked < self.config.store_poll_s:
            return ()
        self._looked = at
        try:
            keys = self.keys.wanted(attempt, cached=cached)
        except StoreError as exc:
            self._outage.failed(exc)
            return ()
        return tuple(sorted(k for k in keys if (attempt, k) not in self._answered))

    def answer(self, attempt: int, mine: NodeFindings) -> None:
        """Publish this node's findings for a key another node asked for."""
        try:
            self._publish(attempt, mine)
        except StoreError as exc:
            self._outage.failed(exc)

    def mark_death(
        self, attempt: int, pid: int, rank: int | None, status: int | None
    ) -> int | None:
        """Record that this node saw its rank ``pid`` die in ``attempt``, now.

        Returns:
            The store's revision of the record (None: the store did not answer).
        """
        try:
            return self.keys.put_death(
                self.node, attempt, pid, json.dumps({"rank": rank, "status": status})
            )
        except StoreError as exc:
            self._outage.failed(exc)
            return None

    def forget(self, attempt: int) -> None:
        """A new attempt starts: remove this node's findings and requests of the old ones."""
        self._answered = {a for a in self._answered if a[0] >= attempt}
        try:
            self.keys.forget_exchange(self.node)
        except StoreError as exc:
            self._outage.failed(exc)

    def _publish(self, attempt: int, mine: NodeFindings) -> None:
        self.keys.put_findings(self.node, attempt, mine.key, mine.to_json())
        self._answered.add((attempt, mine.key))


def _runs(state: NodeState, attempt: int) -> bool:
    return state.attempt == attempt and state.state == RUNNING
