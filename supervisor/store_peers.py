"""The supervisors of one job's nodes, agreeing on its attempts through the job's store.

    peers = StorePeers(EtcdStore(url), "4711", config, metrics)   # config: nnodes, node_rank...
    record = peers.join()                     # the job's current attempt
    go = peers.wait_for_peers(record.number)  # StartAttempt: every node ready (or JobEnded)
    order = peers.watch(go.attempt, step)     # each poll: a restart elsewhere, a lost node, the end
    peers.restart(next_record)                # a restart here is a restart of the job everywhere

Each node's supervisor keeps ``<job>/nodes/<rank>`` alive under a lease of ``node_ttl_s``
(host, pid, attempt, state, step); the job's attempt and its restart policy state live in
``<job>/attempt``, changed only by a compare-and-swap, so two nodes failing at once make one
new attempt; the end of the job for good (an abort, a refused folder, a restart policy that gave
up, a lost node never replaced) is ``<job>/final``, which every node obeys (the keys and their
records: ``store_schema``). A node whose lease expires is lost: the others stop their launchers,
name it, and wait up to ``peer_timeout_s`` for a replacement (a new supervisor with that node
rank) before ending the job, or, ``min_nodes`` allowing, going on without it (``barrier``).

Nothing of a job stays in the store for long: ``attempt``, ``final`` and the records of nodes
that are done live by one job lease of ``job_ttl_s`` (hours), which every live node renews with
its own. The last node to leave a job that ended for good revokes it, so the job's prefix is
empty at once; a job whose nodes all vanished (the whole allocation killed) is gone
``job_ttl_s`` later, while a requeued or replaced node within that time still finds the job's
attempt, restart budget and end. The step a node publishes is written at most once per lease
renewal (``node_ttl_s`` / 3): the lease, not the value, says the node lives, and a lost node is
named at the step the survivors' own ranks reached (in synchronous training, the lost node's
too) beside the lagging one it last published; state changes (waiting, running, done) are
written at once.

While an attempt runs, each node reads the job's keys from its view (``job_view``), which the
store's watches keep: a restart, an end or a request for findings reaches every node at its
next poll, a lost node as soon as its key goes (named by its last record, which the delete
carries), and the store answers no reads at all meanwhile; what a running job costs it is the
lease renewals and the step writes, which reach no other node. While a watch is down the node
asks the store every ``store_poll_s``, as it does at the start barrier. The nodes' findings
about a hang or a crash travel through the store too, gathered by one node for all
(``findings_exchange``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from .barrier import StartBarrier
from .etcd import EtcdStore, StoreError, StoreTLS
from .findings_exchange import FindingsExchange
from .job_store import JobStore, StoreOutage
from .job_view import JobView
from .membership import Membership
from .options import SupervisorConfig
from .orders import JobEnded, JobRestarted, NodesLost, StartAttempt
from .peers import Decide, Settled
from .rank_findings import NodeFindings
from .store_schema import DONE, RUNNING, WAITING, JobAttempt, JobFinal, NodeState
from .telemetry import SupervisorMetrics

log = logging.getLogger("torchvitals.supervisor")


class StorePeers:
    """Several nodes, agreeing through an etcd store.

    Args:
        store: the job's store.
        job_id: the job's identity (the same on every node: the keys' prefix).
        config: ``nnodes``, ``min_nodes``, ``node_rank``, ``node_ttl_s``, ``peer_timeout_s``,
            ``store_poll_s``, ``node_lost_exit_code``.
        metrics: where the nodes present and the wait for peers are shown.
        clock, sleep: monotonic seconds and the wait between polls.
        view: makes the job's view (``job_view``), started when the node joins.
    """

    def __init__(
        self,
        store: EtcdStore,
        job_id: str,
        config: SupervisorConfig,
        metrics: SupervisorMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        view: Callable[[EtcdStore, str], JobView] = JobView,
    ) -> None:
        self.store, self.config, self.metrics = store, config, metrics
        self.keys = JobStore(store, job_id)
        node = config.node_rank or 0  # the Supervisor resolves it (options.node_rank)
        self.me = NodeState(
            node=node,
            host=socket.gethostname(),
            pid=os.getpid(),
            attempt=0,
            state=WAITING,
        )
        self._clock = clock
        self.membership = Membership(self.keys, node=node, nnodes=config.nnodes, metrics=metrics)
        self._outage = StoreOutage()
        self.exchange = FindingsExchange(
            self.keys,
            self.membership,
            config,
            node=node,
            outage=self._outage,
            clock=clock,
            sleep=sleep,
        )
        self._barrier = StartBarrier(
            self.keys,
            self.membership,
            config,
            metrics,
            announce=self._announce,
            finish=self.finish,
            outage=self._outage,
            clock=clock,
            sleep=sleep,
        )
        self._lock = threading.Lock()
        self._renew_s = config.node_ttl_s / 3
        """Seconds between lease renewals, and the least between two writes of a step."""
        self._put_at = -float("inf")
        self._last_watch = -float("inf")
        self._judged = (-1, -1)
        """The view's generation and the attempt at which ``watch`` last found nothing."""
        self._ready: set[int] = set()
        """The attempts whose start barrier this node marked (under its lease)."""
        self._view = view
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    # ------------------------------------------------------------ the job's attempt

    def join(self) -> JobAttempt:
        """Come alive in the store and find the job's attempt.

        A node that joins while the others run an attempt (a replaced node, a restarted
        supervisor) makes a new one: its launcher must start with theirs.
        """
        self.keys.grant_node_lease(self.config.node_ttl_s)
        self._publish(replace(self.me, attempt=0, state=WAITING))
        self._keeper = threading.Thread(
            target=self._keep_alive, daemon=True, name="torchvitals-supervisor-lease"
        )
        self._keeper.start()
        if self.keys.view is None:
            self.keys.view = self._view(self.store, self.keys.prefix)
            self.keys.view.start()
        self.keys.ensure_attempt(JobAttempt(), self.config.job_ttl_s)
        record = self.current()
        others = [s for s in self.membership.nodes().values() if s.node != self.me.node]
        final = self.keys.final()
        if any(s.attempt == record.number and s.state == RUNNING for s in others) or (
            final is not None and final.attempt >= record.number and not others
        ):
            # Running without this node, or ended for good before a requeue: a new attempt.
            record = self.restart(
                replace(record, number=record.number + 1, reason=f"node {self.me.node} joined")
            )
        log.info(
            "torchvitals supervise: node %d of %d joined job %s at attempt %d",
            self.me.node,
            self.config.nnodes,
            self.keys.job_id,
            record.number,
        )
        return record

    def current(self) -> JobAttempt:
        """The job's attempt record as the store has it now."""
        return self.keys.attempt()

    def restart(self, record: JobAttempt) -> JobAttempt:
        """Start ``record`` as the job's next attempt, unless another node already moved the job
        past the attempt ``record`` follows: then that one (one new attempt for all).

        Returns:
            The job's attempt now.
        """
        while True:
            now = self.current()
            if now.number >= record.number:
                return now  # another node restarted the job first
            if self.keys.swap_attempt(record, now.revision):
                return self.current()

    def wait_for_peers(self, attempt: int) -> StartAttempt | JobEnded:
        """The start barrier (``barrier.StartBarrier``): publish "waiting" for ``attempt`` and
        wait until every node is at it (or running it), or the job ends."""
        return self._barrier.wait(attempt)

    def started(self, attempt: int) -> None:
        """This node's launcher runs ``attempt`` (the findings and barrier marks of the
        attempts before go)."""
        self._quietly(self._publish, replace(self.me, attempt=attempt, state=RUNNING, step=0))
        self.exchange.forget(attempt)
        for old in sorted(a for a in self._ready if a < attempt):
            try:
                self.keys.drop_ready(self.me.node, old)
            except StoreError as exc:
                self._outage.failed(exc)
                break
            self._ready.discard(old)

    def settle(
        self, attempt: int, mine: NodeFindings, decide: Decide, *, until_lost: bool = False
    ) -> Settled:
        """One incident decided once for every node that saw it: by this node on every node's
        findings, or by the first to claim it (``findings_exchange``)."""
        return self.exchange.settle(attempt, mine, decide, until_lost=until_lost)

    def asked(self, attempt: int) -> frozenset[str]:
        """Every incident of ``attempt`` a node asked findings for."""
        return self.exchange.asked(attempt)

    def wanted(self, attempt: int, *, now: bool = False) -> tuple[str, ...]:
        """The incidents of ``attempt`` other nodes want this node's findings for."""
        return self.exchange.wanted(attempt, now=now)

    def answer(self, attempt: int, mine: NodeFindings) -> None:
        self.exchange.answer(attempt, mine)

    def mark_death(
        self, attempt: int, pid: int, rank: int | None, status: int | None
    ) -> int | None:
        """Record a rank's death, seen now, in the store; the revision of the write orders it
        among every node's deaths (``death_marks``)."""
        return self.exchange.mark_death(attempt, pid, rank, status)

    def watch(self, attempt: int, step: int) -> JobRestarted | NodesLost | JobEnded | None:
        """While ``attempt`` runs (called every poll): publish this node's step, and say whether
        the job wants something else. Reads the job's view while its watches hold (a change
        anywhere is seen at the next poll, at no cost to the store); asks the store every
        ``store_poll_s`` while they do not.

        Returns:
            None: go on. Else the job ended for good, restarted elsewhere, or lost a node.
        """
        now = self._clock()
        view = self.keys.view
        cached = self.keys.live
        if not cached and now - self._last_watch < self.config.store_poll_s:
            return None
        self._last_watch = now
        try:
            if self.me.step != step and now - self._put_at >= self._renew_s:
                # Read by nothing while the node lives (the view takes no writes of nodes/):
                # its last value names it when it is lost.
                self._publish(replace(self.me, step=step))
            if cached and view is not None and (view.generation, attempt) == self._judged:
                return None  # nothing changed since the view last said "go on"
            generation = -1 if view is None else view.generation
            final = self.keys.final(cached=cached)
            if final is not None and final.attempt >= attempt:
                return JobEnded(final.code, final.reason)
            record = self.keys.attempt(cached=cached)
            if record.number > attempt:
                return JobRestarted(record.number, record.reason)
            nodes = self.keys.nodes(cached=True) if cached else {}
            if not cached or self.membership.members - set(nodes):
                nodes = self.membership.nodes()  # (missing from the view: gone from the store?)
            else:
                self.membership.present(nodes)
        except StoreError as exc:
            # A store that blinks is not a lost job; a node lost for long shows as lost leases.
            self._outage.failed(exc)
            return None
        self._outage.over()
        # A key present is a node alive (or done); one that rejoined under a new supervisor
        # makes a new attempt itself (``join``), which the record shows at the next poll.
        lost = self.membership.lost(nodes, attempt)
        if lost:
            at = tuple(self.membership.published_at.get(s.node) for s in lost)
            return NodesLost(
                lost,
                "; ".join(_lost_line(s, step, t) for s, t in zip(lost, at, strict=True)),
                step=step,
                published_at=at,
            )
        if cached:
            self._judged = (generation, attempt)
        return None

    def finish(self, code: int, reason: str) -> int:
        """End the job for good on every node (the first node to say so wins).

        Returns:
            The exit status every node ends with.
        """
        try:
            self.keys.create_final(JobFinal(code, reason, self.me.node, self.current().number))
            final = self.keys.final()
        except StoreError as exc:  # the others find this node lost; its own code stands
            log.error("torchvitals supervise: cannot tell the other nodes the job ends: %s", exc)
            return code
        return code if final is None else final.code

    def done(self) -> None:
        """This node's launcher exited 0: say so for the job's life (a node that is done is
        not lost), under the job's lease rather than this node's."""
        self._quietly(self._publish, replace(self.me, state=DONE), lease=self.keys.job_lease)

    def close(self) -> None:
        """Stop keeping this node alive; a node that leaves cleanly leaves no live key, and the
        last to leave a job that ended for good (``final``, or every node done) removes the
        job's keys."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
        if self.keys.view is not None:
            self.keys.view.close()
        try:
            if self.keys.node_lease:
                self.store.revoke(self.keys.node_lease)
            if self.keys.job_lease and (self.me.state == DONE or self.keys.final() is not None):
                others = [s for s in self.membership.nodes().values() if s.node != self.me.node]
                # A node still waiting or running needs the record (or the end) yet; it removes
                # the job itself when it leaves.
                if not any(s.state in (WAITING, RUNNING) for s in others):
                    self.store.revoke(self.keys.job_lease)
                    log.info("torchvitals supervise: the job ended; its keys are removed")
        except StoreError as exc:
            log.warning(
                "torchvitals supervise: %s (the job's keys expire within job_ttl_s=%g s)",
                exc,
                self.config.job_ttl_s,
            )

    # ------------------------------------------------------------ pieces

    def _publish(self, state: NodeState, lease: int | None = None) -> None:
        """Write this node's record, under its own lease unless told another."""
        with self._lock:
            self.me = state
            self._put_at = self._clock()
            self.keys.put_node(state, lease)

    def _announce(self, attempt: int) -> None:
        """This node waits at the barrier of ``attempt``: its record and its mark among the
        nodes there (``ready/``), each written when that changes only (the lease says the node
        waits; the value, what for)."""
        waiting = replace(self.me, attempt=attempt, state=WAITING, step=0)
        if waiting != self.me:
            self._publish(waiting)
        if attempt not in self._ready:
            self.keys.put_ready(self.me.node, attempt)
            self._ready.add(attempt)

    def _quietly(self, call: Callable[..., None], *args, **kwargs) -> None:
        """A publication whose loss the others survive (they see the lease, then the next one)."""
        try:
            call(*args, **kwargs)
        except StoreError as exc:
            self._outage.failed(exc)

    def _keep_alive(self) -> None:
        """Renew this node's lease every third of the node's TTL, and the job's every third of
        the job's (hours: one call per node per renewal of that is what a running job costs
        the store). A node lease that expired (the store was away longer than the TTL: the
        others took this node for lost) is replaced, with the state re-put; a job lease that
        expired (every node away for ``job_ttl_s``) takes the job's record with it, which is
        made again. A renewal that fails reopens the job's watches: a network cut that no
        packet reported leaves a watch stream open and silent for minutes, and a view that
        says "nothing changed" while the job restarted elsewhere would keep this node's
        launcher running."""
        job_renew_s = max(self._renew_s, self.config.job_ttl_s / 3)
        job_renewed = time.monotonic()  # the lease was granted (or found) at the join
        while not self._stop.wait(self._renew_s):
            try:
                if not self.store.keepalive(self.keys.node_lease):
                    self.keys.grant_node_lease(self.config.node_ttl_s)
                    if self.me.state != DONE:
                        self._publish(self.me)
                        # Its barrier mark went with the old lease too.
                        self._ready.clear()
                        self.keys.put_ready(self.me.node, self.me.attempt)
                        self._ready.add(self.me.attempt)
                if self.keys.job_lease and time.monotonic() - job_renewed >= job_renew_s:
                    if not self.store.keepalive(self.keys.job_lease) and self.me.state != DONE:
                        self.keys.ensure_attempt(self.keys.record, self.config.job_ttl_s)
                    job_renewed = time.monotonic()
            except StoreError as exc:
                self._outage.failed(exc)
                if self.keys.view is not None:
                    # The watches' streams may have been cut with this call's connection,
                    # without a word: read the store until they are open again.
                    self.keys.view.reconnect()


def _lost_line(state: NodeState, step: int, published_at: float | None) -> str:
    """``node 1 (...) lost at step 25 (it last published step 9, 14 s before; this node's ranks
    are at step 25)``: in synchronous training every rank completes the same steps, so the
    survivors' step is the one the lost node reached; what it published lags by up to a lease
    renewal."""
    ago = "" if published_at is None else f", {max(0.0, time.time() - published_at):.0f} s before"
    return (
        f"{state.name()} lost at step {step} (it last published step {state.step}{ago}; "
        f"this node's ranks are at step {step})"
    )


def store_of(config: SupervisorConfig) -> EtcdStore:
    """The job's store as ``config`` describes it: its URL, TLS files, user and password.

    Raises:
        ValueError: a TLS file or the password file cannot be read (the message names the
            field): a setting to fix before the start, like every other refused setting.
    """
    try:
        return EtcdStore(
            config.store_url or "",
            tls=StoreTLS(
                cafile=config.store_cafile,
                certfile=config.store_certfile,
                keyfile=config.store_keyfile,
            ),
            user=config.store_user,
            password=config.password(),
        )
    except StoreError as exc:
        raise ValueError(str(exc)) from None
