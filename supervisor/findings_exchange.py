"""The nodes' findings about one incident, put together through the job's store, once.

    exchange = FindingsExchange(keys, membership, config, node=0)
    settled = exchange.settle(attempt, mine, decide)   # Settled: this node's decision, or another's
    for key in exchange.wanted(attempt):       # each poll: incidents whose findings are asked for
        exchange.answer(attempt, findings_for(key))
    exchange.mark_death(attempt, pid, rank, status)   # a death seen now: its store revision

A node that sees a hang or a crash publishes what it found about its own ranks under the
incident's key (``reports/a<attempt>/<key>/<node>``) and claims the incident
(``incidents/a<attempt>/<key>``, created only if absent: the first claim in the store's order
wins). Most nodes of a large job see the same hang together; one gathers and decides, the others
wait on their watch for its verdict, so the findings are read once, by one node, however many
saw the incident. The claim is the ask: each node's watch loop sees it at its next poll and
answers with its own ranks, before its launcher is stopped. The claiming node follows that
incident's reports alone on a watch of its own, waits up to ``findings_wait_s`` for every node
running the attempt, decides on what it has (a node lost or too slow is decided without), and
writes the incidents it decided on into the claim. The others take those records as they are: a
node reads the verdict, which carries the culprit's evidence, not every node's stacks.

A claim lives by its node's lease: a node lost while it gathers leaves the incident to the
others, the first of whom to claim it again gathers (and finds the claimer lost). A node whose
verdict never comes (the store away, a claimer that neither decides nor goes) decides alone on
its own findings after the longest a gathering can take. The verdict lives by the job's lease
and the findings by their node's; a node removes its own of the attempts before at the start of
each attempt.

What the nodes share is the store's order, not their clocks: each rank's death is recorded
(``rank_deaths/<node>/a<attempt>/<pid>``) the moment its node sees it, and the revision of that
write orders it among every node's; a node's heartbeat ages are published as of the moment it
asked (or saw the ask, on its own monotonic clock), so every node's count from one moment to
within a store poll.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from ..records.incidents import Incident, IncidentError
from .etcd import StoreError
from .job_store import JobStore, StoreOutage
from .job_view import Followed
from .membership import Membership
from .options import SupervisorConfig
from .peers import Gathered, Settled
from .rank_findings import NodeFindings
from .store_schema import RUNNING, NodeState, Verdict

log = logging.getLogger("torchvitals.supervisor")

GATHER_POLL_S = 0.2
"""How often a node waiting for the others' findings looks for them."""


class FindingsExchange:
    """This node's side of the exchange.

    Args:
        keys: the job's keys.
        membership: the job's nodes (who runs the attempt).
        config: ``findings_wait_s``, ``node_ttl_s``, ``store_poll_s``.
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
        """(attempt, incident key) this node published its findings for."""
        self._claimed: set[tuple[int, str]] = set()
        """(attempt, incident key) this node claimed."""
        self._looked = -float("inf")

    def settle(
        self,
        attempt: int,
        mine: NodeFindings,
        decide: Callable[[Gathered], list[Incident]],
        *,
        until_lost: bool = False,
    ) -> Settled:
        """The incidents the nodes decided on for ``mine.key``: ``decide`` on every node's
        findings where this node claims the incident first, else the claiming node's verdict.

        Args:
            attempt: the job's attempt.
            mine: this node's findings (their key is the incident's).
            decide: the incidents the findings make (and their records written).
            until_lost: a node still silent after ``findings_wait_s`` is waited for until it
                answers or its lease expires (``_gather``).
        """
        mine = mine.as_of(self._clock())  # its heartbeat ages count to the ask
        try:
            self._publish(attempt, mine)
        except StoreError as exc:
            self._outage.failed(exc)
            return Settled(decide(Gathered([mine])), self.node)
        for _ in range(self.config.nnodes + 1):  # a claim goes only with its node's lease
            try:
                claim = self.keys.claim(self.node, attempt, mine.key)
            except StoreError as exc:
                self._outage.failed(exc)
                return Settled(decide(Gathered([mine])), self.node)
            if claim is not None:
                self._claimed.add((attempt, mine.key))
                incidents = decide(self._gather(attempt, mine, until_lost=until_lost))
                verdict = Verdict(self.node, tuple(i.to_dict() for i in incidents))
                try:
                    self.keys.decide(attempt, mine.key, verdict, claim)
                except StoreError as exc:
                    self._outage.failed(exc)
                return Settled(incidents, self.node)
            waited = self._await(attempt, mine.key, until_lost=until_lost)
            if isinstance(waited, Settled):
                return waited
            if waited == _TIMED_OUT:
                break
            # The claim went with its node's lease: claim it again (the first to do so gathers).
        log.warning(
            "torchvitals supervise: %s: no verdict from the node gathering its findings; "
            "deciding on this node's own",
            mine.key,
        )
        return Settled(decide(Gathered([mine])), self.node)

    def _gather(self, attempt: int, mine: NodeFindings, *, until_lost: bool) -> Gathered:
        """Wait up to ``findings_wait_s`` for the findings of each node running ``attempt``,
        following the incident's reports on a watch of their own.

        Args:
            attempt: the job's attempt.
            mine: this node's findings, published.
            until_lost: a node still silent after ``findings_wait_s`` is waited for until it
                answers or its lease expires (``node_ttl_s`` more at most): a crash whose ranks
                died of a node's loss (their collectives failed) is that node's loss.

        Returns:
            Every node's findings found (this node's included), and the nodes found lost.
        """
        start = self._clock()
        deadline = start + self.config.findings_wait_s
        with self.keys.follow_findings(attempt, mine.key) as followed:
            try:  # who runs the attempt: read once, then only the findings are looked at
                running = set(self._running(attempt))
            except StoreError as exc:
                self._outage.failed(exc)
                running = set()
            found, missing = self._look(attempt, mine.key, running, followed)
            while missing and self._clock() < deadline:
                self._sleep(GATHER_POLL_S)
                found, missing = self._look(attempt, mine.key, running, followed)
            lost: dict[int, NodeState] = {}
            if until_lost:
                # A node gone (its lease expired: before the ask, or since) is the cause; one
                # still silent is lost (its lease runs out within node_ttl_s) or busy (it
                # answers).
                deadline = self._clock() + self.config.node_ttl_s + self.config.store_poll_s
                while True:
                    try:
                        alive = self.membership.nodes()  # a key present: alive, or done
                        found = self.keys.findings(attempt, mine.key, followed=followed)
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

    def _await(self, attempt: int, key: str, *, until_lost: bool) -> Settled | str | None:
        """Wait for the verdict of the node that claimed ``key``: the incidents it decided on,
        None when its claim went (its lease expired: claim again), ``_TIMED_OUT`` after the
        longest a gathering can take (and its claimer's lease expiring) with neither."""
        wait_s = self.config.findings_wait_s + self.config.store_poll_s + self.config.node_ttl_s
        if until_lost:
            wait_s += self.config.node_ttl_s
        deadline = self._clock() + wait_s
        claimer = None
        while True:
            live = self.keys.live
            try:
                verdict = self.keys.verdicts(attempt, cached=live).get(key)
                if verdict is None and live:  # the watch may lag the store's answer to the claim
                    verdict = self.keys.verdicts(attempt).get(key)
            except StoreError as exc:
                self._outage.failed(exc)  # unknown: wait on, within the deadline
            else:
                if verdict is None:
                    return None
                if verdict.incidents is not None:
                    return self._taken(verdict, key)
                if verdict.node != claimer:
                    if claimer is not None:  # claimed again: its own gathering's time
                        deadline = self._clock() + wait_s
                    claimer = verdict.node
                    log.info(
                        "torchvitals supervise: %s: node %d gathers the findings; waiting for "
                        "its verdict",
                        key,
                        claimer,
                    )
            if self._clock() >= deadline:
                return _TIMED_OUT
            self._sleep(GATHER_POLL_S)

    def _taken(self, verdict: Verdict, key: str) -> Settled | str:
        """The incidents of ``verdict`` (``_TIMED_OUT``: none that read back)."""
        where = f"node {verdict.node}'s verdict on {key}"
        try:
            incidents = [Incident.from_dict(d, where=where) for d in verdict.incidents or ()]
        except IncidentError as exc:
            log.warning("torchvitals supervise: %s", exc)
            return _TIMED_OUT
        return Settled(incidents, verdict.node) if incidents else _TIMED_OUT

    def asked(self, attempt: int) -> frozenset[str]:
        """Every incident key of ``attempt`` a node claimed (asked the findings of)."""
        try:
            return frozenset(self.keys.verdicts(attempt))
        except StoreError as exc:
            self._outage.failed(exc)
            return frozenset()

    def _look(
        self, attempt: int, key: str, running: set[int], followed: Followed | None
    ) -> tuple[dict[int, str], set[int]]:
        """The findings published for ``key``, and the nodes running ``attempt`` that have not
        published theirs (only nodes running it are waited for: one lost or done has none).
        The findings as the incident's own watch brings them (each once), else from the
        store; who runs the attempt from the job's view while its watches hold (``running``:
        those running it when the ask went out, less any whose lease ran out since), else from
        the store, as it is now. ``running`` is narrowed in place."""
        cached = self.keys.live
        try:
            found = self.keys.findings(attempt, key, followed=followed)
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
        """The incident keys of ``attempt`` another node claimed, has not decided yet, and this
        node has not answered: from the job's view while its watches hold (at every call, at
        no cost to the store), else from the store at most every ``store_poll_s`` unless
        ``now``."""
        at = self._clock()
        cached = not now and self.keys.live
        if not now and not cached and at - self._looked < self.config.store_poll_s:
            return ()
        self._looked = at
        try:
            verdicts = self.keys.verdicts(attempt, cached=cached)
        except StoreError as exc:
            self._outage.failed(exc)
            return ()
        open_ = (k for k, v in verdicts.items() if v.incidents is None and v.node != self.node)
        return tuple(sorted(k for k in open_ if (attempt, k) not in self._answered))

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
        """A new attempt starts: remove this node's findings, claims and verdicts, and its
        ranks' deaths, of the attempts before."""
        old = {a for a in self._answered | self._claimed if a[0] < attempt}
        try:
            for a, key in sorted(old & self._answered):
                self.keys.drop_findings(self.node, a, key)
            for a, key in sorted(old & self._claimed):
                self.keys.drop_verdict(a, key)
            self.keys.drop_deaths(self.node)
        except StoreError as exc:
            self._outage.failed(exc)
            return
        self._answered -= old
        self._claimed -= old

    def _publish(self, attempt: int, mine: NodeFindings) -> None:
        self.keys.put_findings(self.node, attempt, mine.key, mine.to_json())
        self._answered.add((attempt, mine.key))


_TIMED_OUT = "timed out"


def _runs(state: NodeState, attempt: int) -> bool:
    return state.attempt == attempt and state.state == RUNNING
