"""One job's keys in its etcd store, read and written as typed records, and the leases they
live by.

    keys = JobStore(EtcdStore(url), "4711")
    keys.ensure_attempt(JobAttempt(), job_ttl_s=86400)   # the job's record, made once
    record = keys.attempt()                              # JobAttempt, with the store's revision
    keys.swap_attempt(next_record, record.revision)      # compare-and-swap: one winner
    keys.final(), keys.nodes()                           # JobFinal | None; {rank: NodeState}
    keys.put_death(node, attempt, pid, value)            # the store's revision of the write

Two leases: each node's own (``node_lease``: its record dies with it) and the job's
(``job_lease``: ``attempt``, ``final`` and the records of nodes that are done), chosen by
whichever node made the job's record and learned by every other from it. No policy here:
``StorePeers`` decides what to write when.
"""

from __future__ import annotations

import logging

from .etcd import Entry, EtcdStore, StoreError
from .job_view import JobView
from .store_schema import (
    KEY_ROOT,
    JobAttempt,
    JobFinal,
    NodeState,
    attempt_json,
    attempt_of,
    death_key,
    exchange_of,
    final_json,
    final_of,
    findings_key,
    node_json,
    node_key,
    node_of,
    wanted_key,
)

log = logging.getLogger("torchvitals.supervisor")

DEPARTED_WAIT_S = 1.0
"""How long a reader that found a node gone waits for its delete to reach the watch (it
carries the node's last record; the watch brings it within milliseconds of the store)."""


class JobStore:
    """The keys of job ``job_id`` in ``store``.

    Args:
        store: the job's store.
        job_id: the job's identity (the same on every node: the keys' prefix).
    """

    def __init__(self, store: EtcdStore, job_id: str) -> None:
        self.store = store
        self.prefix = f"{KEY_ROOT}{job_id}/"
        self.node_lease = 0
        """This node's lease (0 until granted)."""
        self.job_lease = 0
        """The lease ``attempt``, ``final`` and done nodes' records live by (the job's)."""
        self.record = JobAttempt()
        """The job's attempt record as last read (what is made again if it expires)."""
        self.view: JobView | None = None
        """The job's keys as the store's watches keep them (``cached`` reads), once started."""

    @property
    def job_id(self) -> str:
        return self.prefix[len(KEY_ROOT) : -1]

    def grant_node_lease(self, ttl_s: float) -> int:
        self.node_lease = self.store.grant(ttl_s)
        return self.node_lease

    def attempt(self, *, cached: bool = False) -> JobAttempt:
        """The job's attempt record as the store has it now (the last one read if it has none);
        ``cached``: as the view has it, while it is live."""
        entry = self._reader(cached).get(self._key("attempt"))
        if entry is None:
            return self.record
        if entry.lease:
            self.job_lease = entry.lease  # whoever made the record chose the job's lease
        self.record = attempt_of(entry.value, entry.mod_revision)
        return self.record

    def swap_attempt(self, record: JobAttempt, revision: int) -> bool:
        """Write ``record`` if the job's record is still at ``revision``; whether it was."""
        return self.store.swap(
            self._key("attempt"), attempt_json(record), revision, lease=self.job_lease
        )

    def ensure_attempt(self, record: JobAttempt, job_ttl_s: float) -> None:
        """Make the job's attempt record (``record``) under a new job lease unless it exists;
        either way, follow the lease it lives by."""
        if self.store.get(self._key("attempt")) is None:
            lease = self.store.grant(job_ttl_s)
            if not self.store.create(self._key("attempt"), attempt_json(record), lease=lease):
                self.store.revoke(lease)  # another node made it first: its lease is the job's
        self.attempt()

    def final(self, *, cached: bool = False) -> JobFinal | None:
        """The end of the job for good, if a node wrote it."""
        entry = self._reader(cached).get(self._key("final"))
        return None if entry is None else final_of(entry.value)

    def create_final(self, final: JobFinal) -> None:
        """Write the end of the job unless a node already did (the first one wins)."""
        self.store.create(self._key("final"), final_json(final), lease=self.job_lease)

    def nodes(self, *, cached: bool = False) -> dict[int, NodeState]:
        """The nodes alive (their lease held) or done, by node rank. ``cached``: as the view has
        them, while it is live: the nodes present (their records may be older than the
        store's, and a node that appeared since the view's last read is missing)."""
        prefix = self._key("nodes/")
        if cached and self.view is not None and self.view.live:
            entries = self.view.prefix(prefix)
        elif self.view is not None:
            entries = self.view.reread(prefix)  # the same read, which the view keeps
        else:
            entries = self.store.prefix(prefix)
        nodes = {}
        for entry in entries:
            state = node_of(entry.value)
            if state is not None:
                nodes[state.node] = state
        return nodes

    def departed(self) -> dict[int, tuple[NodeState, float | None]]:
        """The nodes whose key the view saw go since it last saw them present: the record each
        had then, and when this node first saw the store hold it (None: not known)."""
        if self.view is None:
            return {}
        found = {}
        for entry, _ in self.view.departed(wait_s=DEPARTED_WAIT_S).values():
            state = node_of(entry.value)
            if state is not None:
                found[state.node] = (state, self.store.revisions.at(entry.mod_revision))
        return found

    def put_node(self, state: NodeState, lease: int | None = None) -> None:
        """Write a node's record, under this node's lease unless told another."""
        self.store.put(
            self._key(node_key(state.node)),
            node_json(state),
            lease=self.node_lease if lease is None else lease,
        )

    def put_findings(self, node: int, attempt: int, key: str, value: str) -> None:
        """Publish node ``node``'s findings for incident ``key``, under its own lease (they go
        with the node)."""
        self.store.put(self._key(findings_key(node, attempt, key)), value, lease=self.node_lease)

    def want(self, node: int, attempt: int, key: str) -> None:
        """Ask every node for its findings for incident ``key`` of ``attempt``."""
        self.store.put(self._key(wanted_key(node, attempt, key)), "", lease=self.node_lease)

    def put_death(self, node: int, attempt: int, pid: int, value: str) -> int:
        """Record that node ``node`` saw its rank ``pid`` die in ``attempt``, under its own lease.

        Returns:
            The store's revision of the write: its place among every node's deaths.
        """
        return self.store.put(
            self._key(death_key(node, attempt, pid)), value, lease=self.node_lease
        )

    def findings(self, attempt: int, key: str, *, cached: bool = False) -> dict[int, str]:
        """Every node's findings for incident ``key`` of ``attempt``, by node. ``cached``: as
        the view has them, while it is live (the watch brings each node's findings once)."""
        return {
            where[0]: entry.value
            for entry, where in self._exchange("findings/", cached)
            if where[1] == attempt and where[2] == key
        }

    def wanted(self, attempt: int, *, cached: bool = False) -> set[str]:
        """The incident keys of ``attempt`` some node asked findings for."""
        return {where[2] for _, where in self._exchange("wanted/", cached) if where[1] == attempt}

    def forget_exchange(self, node: int) -> None:
        """Remove node ``node``'s findings, requests and deaths (of attempts that are over)."""
        for part in ("findings/", "wanted/", "deaths/"):
            self.store.delete_prefix(self._key(f"{part}{node:05d}/"))

    def _exchange(
        self, part: str, cached: bool = False
    ) -> list[tuple[Entry, tuple[int, int, str]]]:
        found = []
        for entry in self._reader(cached).prefix(self._key(part)):
            where = exchange_of(entry.key[len(self.prefix) :])
            if where is not None:
                found.append((entry, where))
        return found

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _reader(self, cached: bool) -> EtcdStore | JobView:
        """The view while ``cached`` is asked and the view is live, else the store."""
        if cached and self.view is not None and self.view.live:
            return self.view
        return self.store


class StoreOutage:
    """Logs a store outage once, not at every poll, until a poll succeeds again."""

    def __init__(self) -> None:
        self.down = False

    def failed(self, exc: StoreError) -> None:
        if not self.down:
            self.down = True
            log.warning("torchvitals supervise: %s (retrying)", exc)

    def over(self) -> None:
        self.down = False
