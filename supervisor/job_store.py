"""One job's keys in its etcd store, read and written as typed records, and the leases they
live by.

    keys = JobStore(EtcdStore(url), "4711")
    keys.ensure_attempt(JobAttempt(), job_ttl_s=86400)   # the job's record, made once
    record = keys.attempt()                              # JobAttempt, with the store's revision
    keys.swap_attempt(next_record, record.revision)      # compare-and-swap: one winner
    keys.final(), keys.nodes()                           # JobFinal | None; {rank: NodeState}
    keys.put_death(node, attempt, pid, value)            # the store's revision of the write
    revision = keys.claim(node, attempt, key)            # this node gathers key's findings?
    keys.decide(attempt, key, Verdict(node, incidents), revision)   # ... and says what they are

Two leases: each node's own (``node_lease``: its record dies with it) and the job's
(``job_lease``: ``attempt``, ``final`` and the records of nodes that are done), chosen by
whichever node made the job's record and learned by every other from it. No policy here:
``StorePeers`` decides what to write when.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

from .etcd import EtcdStore, StoreError
from .job_view import Followed, JobView
from .store_schema import (
    KEY_ROOT,
    JobAttempt,
    JobFinal,
    NodeState,
    Verdict,
    attempt_json,
    attempt_of,
    death_key,
    deaths_prefix,
    final_json,
    final_of,
    findings_key,
    incident_prefix,
    node_json,
    node_key,
    node_of,
    ready_key,
    ready_prefix,
    report_of,
    reports_prefix,
    verdict_json,
    verdict_key,
    verdict_of,
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
    def live(self) -> bool:
        """The view is started and every watch of it holds: ``cached`` reads are the store's."""
        return self.view is not None and self.view.live

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
        if cached and self.live and self.view is not None:
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

    def drop_findings(self, node: int, attempt: int, key: str) -> None:
        """Remove node ``node``'s findings for incident ``key`` of ``attempt`` (it is over)."""
        self.store.delete(self._key(findings_key(node, attempt, key)))

    def put_death(self, node: int, attempt: int, pid: int, value: str) -> int:
        """Record that node ``node`` saw its rank ``pid`` die in ``attempt``, under its own lease.

        Returns:
            The store's revision of the write: its place among every node's deaths.
        """
        return self.store.put(
            self._key(death_key(node, attempt, pid)), value, lease=self.node_lease
        )

    def put_ready(self, node: int, attempt: int) -> None:
        """Node ``node`` is at the start barrier of ``attempt``, under its own lease."""
        self.store.put(self._key(ready_key(node, attempt)), "", lease=self.node_lease)

    def ready_count(self, attempt: int) -> int:
        """How many nodes came to the start barrier of ``attempt`` (a number, not their keys:
        one small answer however many nodes the job has)."""
        return self.store.count(self._key(ready_prefix(attempt)))

    def drop_ready(self, node: int, attempt: int) -> None:
        """Remove node ``node``'s mark at the barrier of ``attempt`` (an attempt that is over)."""
        self.store.delete(self._key(ready_key(node, attempt)))

    def drop_deaths(self, node: int) -> None:
        """Remove node ``node``'s records of its ranks' deaths (of attempts that are over)."""
        self.store.delete_prefix(self._key(deaths_prefix(node)))

    def follow_findings(self, attempt: int, key: str) -> AbstractContextManager[Followed | None]:
        """Follow every node's findings for incident ``key`` of ``attempt`` on a watch of
        their own (``with``; None: no view, read them from the store)."""
        if self.view is None:
            return nullcontext(None)
        return self.view.follow(self._key(reports_prefix(attempt, key)))

    def findings(
        self, attempt: int, key: str, *, followed: Followed | None = None
    ) -> dict[int, str]:
        """Every node's findings for incident ``key`` of ``attempt``, by node: as ``followed``
        has them while its watch holds (each node's findings come once), else from the
        store."""
        if followed is not None and followed.live:
            entries = followed.entries()
        else:
            entries = self.store.prefix(self._key(reports_prefix(attempt, key)))
        found = {}
        for entry in entries:
            where = report_of(entry.key[len(self.prefix) :])
            if where is not None and where[:2] == (attempt, key):
                found[where[2]] = entry.value
        return found

    def claim(self, node: int, attempt: int, key: str) -> int | None:
        """Node ``node`` gathers the findings of incident ``key`` of ``attempt`` unless a node
        claimed it first, in the store's order: the revision of the claim, or None. The claim
        is the ask every node answers, and lives by ``node``'s lease (a node lost while it
        gathers leaves the incident to the others)."""
        return self.store.create_at(
            self._key(verdict_key(attempt, key)),
            verdict_json(Verdict(node)),
            lease=self.node_lease,
        )

    def decide(self, attempt: int, key: str, verdict: Verdict, revision: int) -> bool:
        """Say what incident ``key`` is, if this node's claim (at ``revision``) still holds;
        under the job's lease, so the verdict outlives the node that wrote it."""
        return self.store.swap(
            self._key(verdict_key(attempt, key)),
            verdict_json(verdict),
            revision,
            lease=self.job_lease,
        )

    def verdicts(self, attempt: int, *, cached: bool = False) -> dict[str, Verdict]:
        """The incidents of ``attempt`` claimed or decided, by key."""
        prefix = self._key(incident_prefix(attempt))
        found = {}
        for entry in self._reader(cached).prefix(prefix):
            verdict = verdict_of(entry.value)
            name = entry.key[len(prefix) :]
            if verdict is not None and "/" not in name:
                found[name] = verdict
        return found

    def drop_verdict(self, attempt: int, key: str) -> None:
        """Remove incident ``key`` of ``attempt``'s claim or verdict (its attempt is over)."""
        self.store.delete(self._key(verdict_key(attempt, key)))

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _reader(self, cached: bool) -> EtcdStore | JobView:
        """The view while ``cached`` is asked and the view is live, else the store."""
        if cached and self.live and self.view is not None:
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
