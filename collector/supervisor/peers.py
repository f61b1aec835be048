"""The supervisors of one job's nodes, agreeing on its attempts through the job's store.

    peers = StorePeers(EtcdStore(url), "4711", config, metrics)   # config: nnodes, node_rank...
    record = peers.join()                     # the job's current attempt
    go = peers.wait_for_peers(record.number)  # every node ready for it (or the job's end)
    order = peers.watch(go.attempt, step)     # each poll: a restart elsewhere, a lost node, the end
    peers.restart(next_record)                # a restart here is a restart of the job everywhere

One node, no store: ``SoloPeers`` (nothing to agree on). Several: each node's supervisor keeps
``<job>/nodes/<rank>`` alive under a lease of ``node_ttl_s`` (host, pid, attempt, state, step);
the job's attempt and its restart policy state live in ``<job>/attempt``, changed only by a
compare-and-swap, so two nodes failing at once make one new attempt; the end of the job for
good (an abort, a refused folder, a restart policy that gave up, a lost node never replaced) is
``<job>/final``, which every node obeys. A node whose lease expires is lost: the others stop
their launchers, name it, and wait up to ``peer_timeout_s`` for a replacement (a new supervisor
with that node rank) before ending the job, or, ``min_nodes`` allowing, going on without it.

Nothing of a job stays in the store for long: ``attempt``, ``final`` and the records of nodes
that are done live by one job lease of ``job_ttl_s`` (hours), which every live node renews with
its own. The last node to leave a job that ended for good revokes it, so the job's prefix is
empty at once; a job whose nodes all vanished (the whole allocation killed) is gone
``job_ttl_s`` later, while a requeued or replaced node within that time still finds the job's
attempt, restart budget and end. The step a node publishes is written at most once per lease
renewal (``node_ttl_s`` / 3): it only names a lost node's last step, and the lease, not the
value, says the node lives; state changes (waiting, running, done) are written at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Protocol

from .config import SupervisorConfig
from .etcd import EtcdStore, StoreError
from .metrics import SupervisorMetrics

log = logging.getLogger("torchvitals.supervisor")

KEY_ROOT = "torchvitals/jobs/"
"""Every key of a job lives under ``KEY_ROOT + <job id> + "/"``."""

WAITING, RUNNING, DONE = "waiting", "running", "done"
"""A node's state: at the start barrier of an attempt; running it; its launcher exited 0."""


@dataclass(frozen=True)
class JobAttempt:
    """The job's attempt and the restart policy's state, the same on every node."""

    number: int = 1
    restarts: int = 0
    """Restarts of the job so far (any node's)."""
    best: int | None = None
    """The highest last healthy step seen at the end of an attempt."""
    stalled: int = 0
    """Restarts in a row that did not move ``best``."""
    reason: str = ""
    """Why this attempt was started (a person reads it)."""
    revision: int = field(default=0, compare=False)
    """The store's revision of the record (for the compare-and-swap); 0 in memory."""


@dataclass(frozen=True)
class NodeState:
    """What one node's supervisor publishes."""

    node: int
    host: str
    pid: int
    attempt: int
    state: str
    step: int = 0
    """The highest heartbeat step of its ranks in this attempt."""

    def name(self) -> str:
        return f"node {self.node} (host {self.host}, supervisor pid {self.pid})"


@dataclass(frozen=True)
class Order:
    """What the job asks of this node while it runs an attempt."""

    attempt: int | None = None
    """Restart into this attempt (another node restarted the job, or a node was lost)."""
    final: int | None = None
    """Stop for good with this exit status."""
    reason: str = ""
    lost: tuple[NodeState, ...] = ()
    """The nodes found lost (their last published state)."""


class Peers(Protocol):
    """What the supervisor asks of the other nodes' supervisors."""

    def join(self) -> JobAttempt: ...

    def current(self) -> JobAttempt: ...

    def wait_for_peers(self, attempt: int) -> Order: ...

    def started(self, attempt: int) -> None: ...

    def watch(self, attempt: int, step: int) -> Order | None: ...

    def restart(self, record: JobAttempt) -> JobAttempt: ...

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

    def wait_for_peers(self, attempt: int) -> Order:
        return Order(attempt=attempt)

    def started(self, attempt: int) -> None:
        pass

    def watch(self, attempt: int, step: int) -> Order | None:
        return None

    def restart(self, record: JobAttempt) -> JobAttempt:
        self._record = record
        return record

    def finish(self, code: int, reason: str) -> int:
        return code

    def done(self) -> None:
        pass

    def close(self) -> None:
        pass


class StorePeers:
    """Several nodes, agreeing through an etcd store.

    Args:
        store: the job's store.
        job_id: the job's identity (the same on every node: the keys' prefix).
        config: ``nnodes``, ``min_nodes``, ``node_rank``, ``node_ttl_s``, ``peer_timeout_s``,
            ``store_poll_s``, ``node_lost_exit_code``.
        metrics: where the nodes present and the wait for peers are shown.
        clock, sleep: monotonic seconds and the wait between polls.
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
    ) -> None:
        self.store, self.config, self.metrics = store, config, metrics
        self.prefix = f"{KEY_ROOT}{job_id}/"
        self.me = NodeState(
            node=config.node_rank,
            host=socket.gethostname(),
            pid=os.getpid(),
            attempt=0,
            state=WAITING,
        )
        self._clock, self._sleep = clock, sleep
        self.members: set[int] = set(range(config.nnodes))
        """The node ranks the job runs on (fewer than ``nnodes`` after it went on without a lost
        node, ``min_nodes`` allowing)."""
        self._alive: dict[int, NodeState] = {}
        self._seen: dict[int, NodeState] = {}
        """The last state each node published (to name a lost one with its host and step)."""
        self._lock = threading.Lock()
        self._lease = 0
        self._job_lease = 0
        """The lease ``attempt``, ``final`` and done nodes' records live by (the job's)."""
        self._renew_s = config.node_ttl_s / 3
        """Seconds between lease renewals, and the least between two writes of a step."""
        self._put_at = -float("inf")
        self._record = JobAttempt()
        self._last_watch = -float("inf")
        self._store_down = False
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    # ------------------------------------------------------------ the job's attempt

    def join(self) -> JobAttempt:
        """Come alive in the store and find the job's attempt.

        A node that joins while the others run an attempt (a replaced node, a restarted
        supervisor) makes a new one: its launcher must start with theirs.
        """
        self._lease = self.store.grant(self.config.node_ttl_s)
        self._publish(replace(self.me, attempt=0, state=WAITING))
        self._keeper = threading.Thread(
            target=self._keep_alive, daemon=True, name="torchvitals-supervisor-lease"
        )
        self._keeper.start()
        self._ensure_record(JobAttempt())
        record = self.current()
        others = [s for s in self._nodes().values() if s.node != self.me.node]
        final = self._final()
        if any(s.attempt == record.number and s.state == RUNNING for s in others) or (
            final is not None and final[2] >= record.number and not others
        ):
            # Running without this node, or ended for good before a requeue: a new attempt.
            record = self.restart(
                replace(record, number=record.number + 1, reason=f"node {self.me.node} joined")
            )
        log.info(
            "torchvitals supervise: node %d of %d joined job %s at attempt %d",
            self.me.node,
            self.config.nnodes,
            self.prefix[len(KEY_ROOT) : -1],
            record.number,
        )
        return record

    def current(self) -> JobAttempt:
        """The job's attempt record as the store has it now."""
        entry = self.store.get(self._key("attempt"))
        if entry is None:
            return self._record
        if entry.lease:
            self._job_lease = entry.lease  # whoever made the record chose the job's lease
        data = json.loads(entry.value)
        self._record = JobAttempt(
            number=int(data["number"]),
            restarts=int(data["restarts"]),
            best=data.get("best"),
            stalled=int(data["stalled"]),
            reason=str(data.get("reason", "")),
            revision=entry.mod_revision,
        )
        return self._record

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
            if self.store.swap(
                self._key("attempt"),
                json.dumps(_record_dict(record)),
                now.revision,
                lease=self._job_lease,
            ):
                return self.current()

    def wait_for_peers(self, attempt: int) -> Order:
        """The start barrier: publish "waiting" for ``attempt`` and wait until every node is at
        it (or running it). A phase of its own: no launcher runs, nothing can hang.

        Returns:
            ``Order(attempt=n)`` to start attempt n (a later one when the job moved on while
            waiting), or ``Order(final=code)`` when the job ended, or no node came in time.
        """
        self.metrics.waiting_for_peers.set(1)
        try:
            deadline = self._clock() + self.config.peer_timeout_s
            reported: set[int] = set()
            while True:
                try:
                    order = self._barrier_poll(attempt, deadline, reported)
                except StoreError as exc:  # a blink of the store; the deadline still holds
                    self._store_failed(exc)
                    order = None
                if (
                    order is not None
                    and order.attempt is not None
                    and order.attempt != attempt
                    and not order.final
                ):
                    attempt = order.attempt  # the job moved on while this node waited
                    deadline = self._clock() + self.config.peer_timeout_s
                    continue
                if order is not None:
                    return order
                if self._clock() > deadline:
                    ready = self._ready(attempt)
                    missing = sorted(self.members - ready)
                    why = "; ".join(self._describe(n) for n in missing)
                    fewest = self.config.min_nodes or self.config.nnodes
                    if len(ready) >= fewest and self.me.node in ready:
                        # torchrun --nnodes MIN:MAX: go on with the nodes there are; the job
                        # resumes its last healthy checkpoint at the new world size.
                        self.members = ready
                        log.error(
                            "torchvitals supervise: %s: no node took its place within "
                            "%g s; the job goes on with %d of %d nodes (%s): the world "
                            "size changes",
                            why,
                            self.config.peer_timeout_s,
                            len(ready),
                            self.config.nnodes,
                            ", ".join(map(str, sorted(ready))),
                        )
                        return Order(attempt=attempt)
                    reason = (
                        f"{why}: no node took its place within "
                        f"{self.config.peer_timeout_s:g} s (peer_timeout_s)"
                    )
                    log.error("torchvitals supervise: %s; stopping the job", reason)
                    return Order(
                        final=self.finish(self.config.node_lost_exit_code, reason), reason=reason
                    )
                self._sleep(self.config.store_poll_s)
        finally:
            self.metrics.waiting_for_peers.set(0)

    def _barrier_poll(self, attempt: int, deadline: float, reported: set[int]) -> Order | None:
        """One look at the barrier: an order to start (maybe a later attempt), the end, or None
        (keep waiting)."""
        waiting = replace(self.me, attempt=attempt, state=WAITING, step=0)
        if waiting != self.me:  # the lease says the node waits; the value, what for
            self._publish(waiting)
        final = self._final()
        if final is not None and final[2] >= attempt:
            return Order(final=final[0], reason=final[1])
        record = self.current()
        if record.number > attempt:
            return Order(attempt=record.number)
        ready = self._ready(attempt)
        if ready >= self.members:
            self.members |= ready  # a replacement rejoins a job that went on without it
            return Order(attempt=attempt)
        for n in sorted(set(self._seen) - ready - reported - set(self._alive)):
            reported.add(n)
            log.error(
                "torchvitals supervise: %s; waiting up to %.0f s more for a node to take its place",
                self._describe(n),
                max(0.0, deadline - self._clock()),
            )
        return None

    def _ready(self, attempt: int) -> set[int]:
        """The nodes at the barrier of ``attempt`` or running it."""
        self._alive = self._nodes()
        return {
            n
            for n, s in self._alive.items()
            if s.attempt == attempt and s.state in (WAITING, RUNNING)
        }

    def started(self, attempt: int) -> None:
        """This node's launcher runs ``attempt``."""
        self._quietly(self._publish, replace(self.me, attempt=attempt, state=RUNNING, step=0))

    def watch(self, attempt: int, step: int) -> Order | None:
        """While ``attempt`` runs (called every poll; asks the store every ``store_poll_s``):
        publish this node's step, and say whether the job wants something else.

        Returns:
            None: go on. Else the job ended for good, restarted elsewhere, or lost a node.
        """
        now = self._clock()
        if now - self._last_watch < self.config.store_poll_s:
            return None
        self._last_watch = now
        try:
            if self.me.step != step and now - self._put_at >= self._renew_s:
                self._publish(replace(self.me, step=step))
            final = self._final()
            if final is not None and final[2] >= attempt:
                return Order(final=final[0], reason=final[1])
            record = self.current()
            if record.number > attempt:
                return Order(attempt=record.number, reason=record.reason)
            nodes = self._nodes()
        except StoreError as exc:
            # A store that blinks is not a lost job; a node lost for long shows as lost leases.
            self._store_failed(exc)
            return None
        self._store_down = False
        # A key present is a node alive (or done); one that rejoined under a new supervisor
        # makes a new attempt itself (``join``), which the record shows at the next poll.
        lost = tuple(
            self._seen.get(n, NodeState(n, "?", 0, attempt, WAITING))
            for n in sorted(self.members)
            if n not in nodes
        )
        if lost:
            return Order(
                lost=lost, reason="; ".join(f"{s.name()} lost at step {s.step}" for s in lost)
            )
        return None

    def finish(self, code: int, reason: str) -> int:
        """End the job for good on every node (the first node to say so wins).

        Returns:
            The exit status every node ends with.
        """
        try:
            self.store.create(
                self._key("final"),
                json.dumps(
                    {
                        "code": code,
                        "reason": reason,
                        "node": self.me.node,
                        "attempt": self.current().number,
                    }
                ),
                lease=self._job_lease,
            )
            final = self._final()
        except StoreError as exc:  # the others find this node lost; its own code stands
            log.error("torchvitals supervise: cannot tell the other nodes the job ends: %s", exc)
            return code
        return code if final is None else final[0]

    def done(self) -> None:
        """This node's launcher exited 0: say so for the job's life (a node that is done is
        not lost), under the job's lease rather than this node's."""
        self._quietly(self._publish, replace(self.me, state=DONE), lease=self._job_lease)

    def close(self) -> None:
        """Stop keeping this node alive; a node that leaves cleanly leaves no live key, and the
        last to leave a job that ended for good (``final``, or every node done) removes the
        job's keys."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
        try:
            if self._lease:
                self.store.revoke(self._lease)
            if self._job_lease and (self.me.state == DONE or self._final() is not None):
                others = [s for s in self._nodes().values() if s.node != self.me.node]
                # A node still waiting or running needs the record (or the end) yet; it removes
                # the job itself when it leaves.
                if not any(s.state in (WAITING, RUNNING) for s in others):
                    self.store.revoke(self._job_lease)
                    log.info("torchvitals supervise: the job ended; its keys are removed")
        except StoreError as exc:
            log.warning(
                "torchvitals supervise: %s (the job's keys expire within job_ttl_s=%g s)",
                exc,
                self.config.job_ttl_s,
            )

    # ------------------------------------------------------------ pieces

    def _quietly(self, call: Callable[..., None], *args, **kwargs) -> None:
        """A publication whose loss the others survive (they see the lease, then the next one)."""
        try:
            call(*args, **kwargs)
        except StoreError as exc:
            self._store_failed(exc)

    def _store_failed(self, exc: StoreError) -> None:
        """Log a store outage once, not at every poll."""
        if not self._store_down:
            self._store_down = True
            log.warning("torchvitals supervise: %s (retrying)", exc)

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _publish(self, state: NodeState, lease: int | None = None) -> None:
        """Write this node's record, under its own lease unless told another."""
        with self._lock:
            self.me = state
            self._put_at = self._clock()
            self.store.put(
                self._key(f"nodes/{state.node:05d}"),
                json.dumps(asdict(state)),
                lease=self._lease if lease is None else lease,
            )

    def _ensure_record(self, record: JobAttempt) -> None:
        """Make the job's attempt record (``record``) under a new job lease unless it exists;
        either way, follow the lease it lives by."""
        if self.store.get(self._key("attempt")) is None:
            lease = self.store.grant(self.config.job_ttl_s)
            if not self.store.create(
                self._key("attempt"), json.dumps(_record_dict(record)), lease=lease
            ):
                self.store.revoke(lease)  # another node made it first: its lease is the job's
        self.current()

    def _nodes(self) -> dict[int, NodeState]:
        """The nodes alive (their lease held) or done, by node rank; updates the metrics."""
        nodes = {}
        for entry in self.store.prefix(self._key("nodes/")):
            try:
                state = NodeState(**json.loads(entry.value))
            except (TypeError, ValueError):
                continue
            nodes[state.node] = state
            if state.pid:
                self._seen[state.node] = state
        # Each node publishes its own presence only: O(nodes) series for the job, not O(nodes^2).
        self.metrics.node_present.labels(str(self.me.node)).set(1 if self.me.node in nodes else 0)
        self.metrics.nodes_present.set(len(nodes))
        self.metrics.nodes_expected.set(len(self.members))
        return nodes

    def _final(self) -> tuple[int, str, int] | None:
        entry = self.store.get(self._key("final"))
        if entry is None:
            return None
        data = json.loads(entry.value)
        return int(data["code"]), str(data["reason"]), int(data["attempt"])

    def _describe(self, node: int) -> str:
        seen = self._seen.get(node)
        if seen is None:
            return f"node {node} never joined"
        return f"{seen.name()} lost at step {seen.step}"

    def _keep_alive(self) -> None:
        """Renew this node's lease and the job's every third of the node's TTL. A node lease
        that expired (the store was away longer than the TTL: the others took this node for
        lost) is replaced, with the state re-put; a job lease that expired (every node away
        for ``job_ttl_s``) takes the job's record with it, which is made again."""
        while not self._stop.wait(self._renew_s):
            try:
                if not self.store.keepalive(self._lease):
                    self._lease = self.store.grant(self.config.node_ttl_s)
                    if self.me.state != DONE:
                        self._publish(self.me)
                if (
                    self._job_lease
                    and not self.store.keepalive(self._job_lease)
                    and self.me.state != DONE
                ):
                    self._ensure_record(self._record)
            except StoreError as exc:
                self._store_failed(exc)


def _record_dict(record: JobAttempt) -> dict:
    data = asdict(record)
    data.pop("revision")
    return data
