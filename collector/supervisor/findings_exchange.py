"""The nodes' findings about one incident, put together through the job's store.

    exchange = FindingsExchange(keys, membership, config, node=0)
    every = exchange.gather(attempt, mine)     # publish, ask the others, wait for them (bounded)
    for key in exchange.wanted(attempt):       # each poll: what others asked this node
        exchange.answer(attempt, findings_for(key))

A node that sees a hang or a crash publishes what it found about its own ranks under the
incident's key (``findings/<node>/a<attempt>/<key>``) and asks every node for theirs
(``wanted/<node>/a<attempt>/<key>``); each node's watch loop looks for such requests at every
store poll and answers with its own ranks, before its launcher is stopped. The node that asked
waits up to ``findings_wait_s`` for every node running the attempt, then decides on what it has
(a node lost or too slow is decided without). Every key lives by its writer's node lease, and a
node removes its own at the start of each attempt: nothing of an old attempt stays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .etcd import StoreError
from .findings import NodeFindings
from .job_records import RUNNING
from .job_store import JobStore, StoreOutage
from .membership import Membership
from .options import SupervisorConfig

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

    def gather(self, attempt: int, mine: NodeFindings) -> list[NodeFindings]:
        """Publish ``mine``, ask every node for its findings under the same key, and wait up to
        ``findings_wait_s`` for each node running ``attempt``.

        Returns:
            Every node's findings found (this node's included), by node.
        """
        try:
            self._publish(attempt, mine)
            self.keys.want(self.node, attempt, mine.key)
        except StoreError as exc:
            self._outage.failed(exc)
            return [mine]
        deadline = self._clock() + self.config.findings_wait_s
        while True:
            try:
                found = self.keys.findings(attempt, mine.key)
                running = {
                    n
                    for n, s in self.membership.nodes().items()
                    if s.attempt == attempt and s.state == RUNNING
                }
            except StoreError as exc:
                self._outage.failed(exc)
                found, running = {}, set()
            # Only nodes running the attempt are waited for (one lost or done has nothing).
            missing = running - set(found) - {self.node}
            if not missing or self._clock() >= deadline:
                break
            self._sleep(GATHER_POLL_S)
        if missing:
            log.warning(
                "torchvitals supervise: %s: no findings from node(s) %s within %g s "
                "(findings_wait_s); deciding without them",
                mine.key,
                ", ".join(map(str, sorted(missing))),
                self.config.findings_wait_s,
            )
        out = {self.node: mine}
        for node, text in found.items():
            if node == self.node:
                continue
            try:
                out[node] = NodeFindings.from_json(text)
            except ValueError as exc:
                log.warning("torchvitals supervise: node %d's findings: %s", node, exc)
        return [out[n] for n in sorted(out)]

    def wanted(self, attempt: int, *, now: bool = False) -> tuple[str, ...]:
        """The incident keys of ``attempt`` another node asked for and this node has not
        answered; asks the store at most every ``store_poll_s`` unless ``now``."""
        at = self._clock()
        if not now and at - self._looked < self.config.store_poll_s:
            return ()
        self._looked = at
        try:
            keys = self.keys.wanted(attempt)
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
