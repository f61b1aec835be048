"""The store's watch against a real etcd: a change one client makes reaches another's view, a
lease that runs out shows as its key's delete (with its last value), and the view comes back
after etcd compacted what it would have watched from, after etcd restarted under it, and with
TLS, client certificates and a token that expired.

    python -m pytest tests/multinode/test_store_watch.py
"""

from __future__ import annotations

import base64
import time
import uuid

import pytest
from cluster import PASSWORDS, Etcd
from test_store import client_tls, start, two_nodes

from torchvitals.supervisor.etcd import Entry, EtcdStore
from torchvitals.supervisor.etcd_watch import RangeWatch
from torchvitals.supervisor.job_view import JobView, RangePart
from torchvitals.supervisor.orders import NodesLost
from torchvitals.supervisor.store_schema import KEY_ROOT

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def etcd(tmp_path):
    with Etcd(tmp_path) as server:
        yield server


def job() -> str:
    return f"{KEY_ROOT}watch-{uuid.uuid4().hex[:8]}/"


def until(predicate, timeout_s: float = 5.0) -> float:
    """Seconds until ``predicate()`` held (fails after ``timeout_s``)."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "not within the time"
        time.sleep(0.01)
    return time.monotonic() - started


def value(view: JobView, key: str) -> str | None:
    entry = view.get(key)
    return None if entry is None else entry.value


def test_a_change_one_client_makes_reaches_another_clients_view(etcd):
    prefix = job()
    writer = EtcdStore(etcd.url)
    writer.put(prefix + "attempt", "1")
    view = JobView(EtcdStore(etcd.url), prefix)
    view.start()
    try:
        until(lambda: view.live)
        assert value(view, prefix + "attempt") == "1"  # the read before the watch
        writer.put(prefix + "attempt", "2")
        writer.put(prefix + "incidents/a0002/hang-a0002", '{"node": 1}')
        writer.put(prefix + "reports/a0002/hang-a0002/00001", "{}")  # followed by no view
        writer.put(prefix + "final", "{}")
        took = until(lambda: value(view, prefix + "final") == "{}")
        assert took < 1.0, took
        assert value(view, prefix + "attempt") == "2"
        assert [e.key for e in view.prefix(prefix + "incidents/")] == [
            prefix + "incidents/a0002/hang-a0002"
        ]
        # The node that gathers follows one incident's reports for a while: the read, then
        # each node's findings as they come.
        with view.follow(prefix + "reports/a0002/hang-a0002/") as reports:
            until(lambda: reports.live)
            writer.put(prefix + "reports/a0002/hang-a0002/00002", "{}")
            writer.put(prefix + "reports/a0002/hang-a0003/00002", "{}")  # another incident's
            until(lambda: len(reports.entries()) == 2)
            assert [e.key[len(prefix) :] for e in reports.entries()] == [
                "reports/a0002/hang-a0002/00001",
                "reports/a0002/hang-a0002/00002",
            ]
        assert not reports.live
    finally:
        view.close()


def test_a_lease_that_runs_out_is_a_delete_with_the_nodes_last_record(etcd):
    prefix = job()
    writer = EtcdStore(etcd.url)
    lease = writer.grant(2)
    writer.put(prefix + "nodes/00001", '{"step": 0}', lease=lease)
    view = JobView(EtcdStore(etcd.url), prefix)
    view.start()
    try:
        until(lambda: view.live)
        generation = view.generation
        writer.put(prefix + "nodes/00001", '{"step": 9}', lease=lease)
        time.sleep(0.3)
        # A node's step writes reach no one: the view still has the record as read...
        assert value(view, prefix + "nodes/00001") == '{"step": 0}'
        assert view.generation == generation
        # ...until its lease runs out: then its key goes, and its last record with it.
        until(lambda: not view.prefix(prefix + "nodes/"), timeout_s=10)
        (gone, deleted_at) = view.departed()[prefix + "nodes/00001"]
        assert gone.value == '{"step": 9}' and deleted_at > gone.mod_revision
        assert view.live
    finally:
        view.close()


class CompactingStore(EtcdStore):
    """Reads the range once, then writes past it and compacts: the watch asked for from that
    read is canceled, as after a long outage in which the store compacted its history."""

    compacted = False

    def snapshot(self, key: str, range_end: str) -> tuple[list[Entry], int]:
        read = super().snapshot(key, range_end)
        if not self.compacted:
            self.compacted = True
            prefix = base64.b64decode(key).decode()
            self.put(prefix + "attempt", "after the read")
            revision = self.put(prefix + "attempt", "compacted")
            self._call("/v3/kv/compaction", {"revision": str(revision)})
        return read


def test_the_view_is_read_again_after_a_compaction(etcd):
    prefix = job()
    store = CompactingStore(etcd.url)
    part = RangePart(lambda: None)
    key = base64.b64encode(prefix.encode()).decode()
    end = base64.b64encode((prefix[:-1] + "0").encode()).decode()
    watch = RangeWatch(store, key=key, range_end=end, sink=part)
    watch.start()
    try:
        until(lambda: part.live and prefix + "attempt" in part.snapshot()[0])
        assert part.snapshot()[0][prefix + "attempt"].value == "compacted"
        assert watch.connects == 2  # the canceled watch, then the one after the new read
        EtcdStore(etcd.url).put(prefix + "attempt", "followed")
        until(lambda: part.snapshot()[0][prefix + "attempt"].value == "followed")
    finally:
        watch.close()


def test_the_view_comes_back_after_the_store_restarted(etcd):
    prefix = job()
    view = JobView(EtcdStore(etcd.url, timeout_s=1), prefix)
    view.start()
    try:
        until(lambda: view.live)
        etcd.__exit__()  # the store closes every stream
        until(lambda: not view.live)  # readers fall back to asking the store
        etcd.__enter__()  # the same data and port
        writer = EtcdStore(etcd.url)
        writer.put(prefix + "attempt", "after the restart")
        until(lambda: view.live and value(view, prefix + "attempt") == "after the restart", 15)
        writer.put(prefix + "final", "{}")
        until(lambda: value(view, prefix + "final") == "{}")
    finally:
        view.close()


def test_the_view_works_with_tls_client_certificates_and_an_expiring_token(auth_etcd, certs):
    prefix = job()

    def store() -> EtcdStore:
        return EtcdStore(
            auth_etcd.url,
            tls=client_tls(certs),
            user="supervisor",
            password=PASSWORDS["supervisor"],
        )

    writer, reader = store(), store()
    writer.put(prefix + "attempt", "1")
    view = JobView(reader, prefix)
    view.start()
    try:
        until(lambda: view.live and value(view, prefix + "attempt") == "1")
        token = reader.token
        time.sleep(3)  # > --auth-token-ttl 1, plus etcd's 1 s sweep: the token is gone
        writer.put(prefix + "attempt", "2")  # the open stream goes on
        until(lambda: value(view, prefix + "attempt") == "2")
        for watch in view._watches:
            watch._shut()  # the next watch needs a token again: a new one
        writer.put(prefix + "attempt", "3")
        until(lambda: view.live and value(view, prefix + "attempt") == "3", 10)
        assert reader.token is not None and reader.token != token
    finally:
        view.close()


def test_a_running_node_reads_nothing_from_the_store_and_sees_a_loss_at_once(etcd):
    nodes = two_nodes(etcd, f"steady-{uuid.uuid4().hex[:8]}")
    try:
        start(nodes)
        until(lambda: all(n.keys.view is not None and n.keys.view.live for n in nodes))
        time.sleep(1.1)  # a lease renewal (node_ttl_s / 3) after its start: its step is written
        nodes[1].watch(1, 7)
        paths: list[str] = []
        call = nodes[0].store._call
        nodes[0].store._call = lambda path, body: (paths.append(path), call(path, body))[1]
        started = time.monotonic()
        while time.monotonic() - started < 1.5:  # 30 polls, every one a look at the job
            assert nodes[0].watch(1, 7) is None
            assert nodes[0].wanted(1) == ()
            time.sleep(0.05)
        assert "/v3/kv/range" not in paths, paths  # the view answered them all
        nodes[1]._stop.set()
        nodes[1].store.revoke(nodes[1].keys.node_lease)  # its machine is gone
        order = None
        lost_at = time.monotonic()
        while order is None:
            assert time.monotonic() - lost_at < 2
            order = nodes[0].watch(1, 9)
            time.sleep(0.01)
        assert isinstance(order, NodesLost) and [s.node for s in order.lost] == [1]
        assert "lost at step 9 (it last published step 7, " in order.reason
    finally:
        for node in nodes:
            node.close()
