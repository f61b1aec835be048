"""The store's watch without a store: the gateway's stream as etcd 3.4 writes it, the watch's
read-then-follow loop against a fake store (reconnects, compaction, a refused token), and the
job's view built from it (what a running supervisor reads instead of asking the store).

    python -m pytest tests/unit/test_etcd_watch.py
"""

from __future__ import annotations

import base64
import json
import threading
import time
from typing import ClassVar

import pytest

from torchvitals.supervisor.etcd import Entry, RevisionClock, StoreError
from torchvitals.supervisor.etcd_watch import RangeWatch, WatchError, parse, responses
from torchvitals.supervisor.job_store import JobStore
from torchvitals.supervisor.job_view import JobView, RangePart
from torchvitals.supervisor.membership import Membership
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.store_peers import StorePeers
from torchvitals.supervisor.store_schema import RUNNING, NodeState, node_json
from torchvitals.supervisor.telemetry import SupervisorMetrics

pytestmark = pytest.mark.timeout(20)

P = "torchvitals/jobs/j/"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def kv(key: str, value: str = "", rev: int = 1, **more) -> dict:
    out = {"key": b64(key), "mod_revision": str(rev), **more}
    if value:
        out["value"] = b64(value)
    return out


def line(**result) -> bytes:
    return json.dumps({"result": {"header": {"revision": "9"}, **result}}).encode() + b"\n"


# Lines exactly as etcd 3.4's gateway wrote them (a PUT's type left out: proto3's zero value).
CREATED = (
    b'{"result":{"header":{"cluster_id":"78","member_id":"13","revision":"2","raft_term":"2"},'
    b'"created":true}}\n'
)
PUT = (
    b'{"result":{"header":{"cluster_id":"78","member_id":"13","revision":"3","raft_term":"2"},'
    b'"events":[{"kv":{"key":"cC9i","create_revision":"3","mod_revision":"3","version":"1",'
    b'"value":"Mg==","lease":"5007618248273088519"}}]}}\n'
)
DELETE = (
    b'{"result":{"header":{"revision":"5"},"events":[{"type":"DELETE","kv":{"key":"cC9i",'
    b'"mod_revision":"5"},"prev_kv":{"key":"cC9i","mod_revision":"3","value":"Mg=="}}]}}\n'
)
COMPACTED = (
    b'{"result":{"header":{"cluster_id":"78","member_id":"13","raft_term":"2"},'
    b'"canceled":true,"compact_revision":"6"}}\n'
)


def test_the_gateways_lines_parse_as_etcd_wrote_them():
    assert parse(CREATED).created and parse(CREATED).revision == 2
    (put,) = parse(PUT).events
    assert not put.deleted and (put.entry.key, put.entry.value) == ("p/b", "2")
    assert (put.entry.mod_revision, put.entry.lease) == (3, 5007618248273088519)
    (gone,) = parse(DELETE).events
    assert gone.deleted and gone.entry.key == "p/b" and gone.entry.mod_revision == 5
    assert gone.previous is not None and gone.previous.value == "2"
    compacted = parse(COMPACTED)
    assert compacted.canceled and compacted.compact_revision == 6 and not compacted.events
    assert [r.revision for r in responses([CREATED, b"\n", PUT])] == [2, 3]


def test_a_failed_stream_is_an_error_and_a_refused_token_says_so():
    refused = b'{"error":{"grpc_code":16,"http_code":401,"message":"invalid auth token"}}'
    with pytest.raises(WatchError, match="invalid auth token") as exc:
        parse(refused)
    assert exc.value.unauthenticated and isinstance(exc.value, StoreError)
    with pytest.raises(WatchError) as exc:
        parse(b'{"error":{"grpc_code":14,"message":"unavailable"}}')
    assert not exc.value.unauthenticated
    with pytest.raises(WatchError, match="sent"):
        parse(b"<html>")


# ---------------------------------------------------------------- the watch's loop


class FakeStream:
    def __init__(self, lines: list[bytes], hold: threading.Event | None = None) -> None:
        self.lines, self.hold, self.closed = list(lines), hold, threading.Event()

    def readline(self) -> bytes:
        if self.lines:
            return self.lines.pop(0)
        if self.hold is not None:  # an open, quiet stream: until closed
            self.closed.wait(10)
        return b""

    def close(self) -> None:
        self.closed.set()


class FakeStore:
    """Answers each read with the next of ``reads`` and each stream with the next of
    ``streams`` (an exception: raised)."""

    def __init__(self, reads, streams) -> None:
        self.reads, self.streams = list(reads), list(streams)
        self.bodies: list[dict] = []
        self.revisions = RevisionClock()
        self.token: str | None = "t1"
        self.forgotten: list[str | None] = []

    def snapshot(self, key, range_end):
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]

    def stream(self, path, body):
        self.bodies.append(body)
        stream = self.streams.pop(0) if self.streams else FakeStream([], threading.Event())
        if isinstance(stream, Exception):
            raise stream
        return stream

    def forget_token(self, token):
        self.forgotten.append(token)


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.done = threading.Event()

    def reset(self, entries, revision):
        self.calls.append(("reset", [e.key for e in entries], revision))

    def apply(self, response):
        self.calls.append(("apply", [(e.deleted, e.entry.key) for e in response.events]))

    def lost(self):
        self.calls.append(("lost",))


def wait_until(condition) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, "not within 5 s"
        time.sleep(0.005)


def run(store: FakeStore, sink: Sink, until, **kwargs) -> RangeWatch:
    watch = RangeWatch(store, key="a", range_end="b", sink=sink, retry_s=0.01, **kwargs)
    watch.start()
    deadline = time.monotonic() + 5
    while not until() and time.monotonic() < deadline:
        time.sleep(0.005)
    watch.close()
    return watch


def test_the_watch_reads_the_range_then_follows_it_from_the_next_revision():
    entry = Entry("p/a", "1", 7)
    store = FakeStore([([entry], 7)], [FakeStream([CREATED, PUT, DELETE], threading.Event())])
    sink = Sink()
    run(store, sink, lambda: len(sink.calls) >= 3, filters=("NOPUT",), prev_kv=True)
    assert store.bodies[0] == {
        "create_request": {
            "key": "a",
            "range_end": "b",
            "start_revision": "8",
            "filters": ["NOPUT"],
            "prev_kv": True,
        }
    }
    # Live only once the store said the watch is created: nothing between read and watch lost.
    assert sink.calls[:3] == [
        ("reset", ["p/a"], 7),
        ("apply", [(False, "p/b")]),
        ("apply", [(True, "p/b")]),
    ]
    assert store.revisions.at(5) is not None  # the stream's revisions are seen


def test_a_closed_stream_or_a_compaction_is_read_again_and_an_error_retried():
    store = FakeStore(
        [([], 3), ([Entry("p/a", "1", 4)], 4), ([], 10)],
        [
            FakeStream([CREATED]),  # the store closes it
            FakeStream([CREATED, COMPACTED, PUT]),  # compacted: the PUT after is not trusted
            StoreError("etcd at x: connection refused"),
            FakeStream([CREATED], threading.Event()),
        ],
    )
    sink = Sink()
    watch = run(store, sink, lambda: sum(c[0] == "reset" for c in sink.calls) >= 3)
    resets = [c for c in sink.calls if c[0] == "reset"]
    assert resets[:3] == [("reset", [], 3), ("reset", ["p/a"], 4), ("reset", [], 10)]
    assert ("apply", [(False, "p/b")]) not in sink.calls
    # Each break tells the sink it is stale before the next read.
    kinds = [c[0] for c in sink.calls]
    assert kinds[:4] == ["reset", "lost", "reset", "lost"]
    assert watch.connects == 3


def test_a_refused_token_is_fetched_again_before_the_next_watch():
    refused = FakeStream([b'{"error":{"grpc_code":16,"message":"invalid auth token"}}'])
    store = FakeStore([([], 3)], [refused, FakeStream([CREATED], threading.Event())])
    sink = Sink()
    run(store, sink, lambda: sum(c[0] == "reset" for c in sink.calls) >= 1)
    assert store.forgotten == ["t1"]


# ---------------------------------------------------------------- what a watch keeps


def put(key: str, value: str, rev: int) -> bytes:
    return line(events=[{"kv": kv(key, value, rev)}])


def delete(key: str, rev: int, before: str | None = None, before_rev: int = 1) -> bytes:
    event: dict = {"type": "DELETE", "kv": kv(key, rev=rev)}
    if before is not None:
        event["prev_kv"] = kv(key, before, before_rev)
    return line(events=[event])


def test_a_part_keeps_its_keys_and_names_the_ones_that_went():
    changes = []
    part = RangePart(lambda: changes.append(1))
    part.reset([Entry("n/1", "a", 3), Entry("n/2", "b", 4)], 4)
    part.apply(parse(put("n/3", "c", 5)))
    part.apply(parse(delete("n/1", 6, before="a2", before_rev=5)))
    part.apply(parse(delete("n/2", 7)))  # no prev_kv asked: the value as last read
    part.apply(parse(put("n/9", "old", 4)))  # already in the read: not applied twice
    entries, departed = part.snapshot()
    assert sorted(entries) == ["n/3"]
    assert {k: (e.value, r) for k, (e, r) in departed.items()} == {
        "n/1": ("a2", 6),
        "n/2": ("b", 7),
    }
    # A read that shows a departed key present again (at or after its delete) forgets it went.
    part.reset([Entry("n/1", "back", 8)], 8)
    assert set(part.snapshot()[1]) == {"n/2"}
    # A read older than what was applied is ignored while the watch holds.
    part.reset([], 2)
    assert set(part.snapshot()[0]) == {"n/1"}
    part.lost()
    assert not part.live and len(changes) == 7


def test_a_delete_a_read_found_first_still_brings_the_nodes_last_record():
    """A node's lease runs out; a reader that found it missing reads the range again before
    the delete reaches the watch. The delete, now older than the read, still names the value
    the node last wrote (not the stale one the view had); a reader waits for it briefly."""
    part = RangePart(lambda: None, deletes_only=True)
    part.reset([Entry("n/1", "waiting, step 0", 3), Entry("n/2", "b", 4)], 4)
    part.reset([Entry("n/2", "b", 4)], 9)  # the reread: n/1 is gone, its delete not yet seen
    assert part.pending() and part.snapshot()[1] == {}
    part.apply(parse(delete("n/1", 8, before="running, step 14", before_rev=7)))
    assert not part.pending()
    assert {k: (e.value, r) for k, (e, r) in part.snapshot()[1].items()} == {
        "n/1": ("running, step 14", 8)
    }
    # A key present again in a later read is no longer waited for.
    part.reset([Entry("n/2", "b", 4)], 10)
    part.reset([Entry("n/2", "b", 4), Entry("n/3", "c", 11)], 11)
    part.reset([Entry("n/2", "b", 4)], 12)
    part.reset([Entry("n/2", "b", 4), Entry("n/3", "c", 13)], 13)
    assert not part.pending()


class FakeWatch:
    made: ClassVar[list[FakeWatch]] = []

    def __init__(self, store, *, key, range_end, sink, filters, prev_kv) -> None:
        self.key, self.range_end, self.sink = key, range_end, sink
        self.filters, self.prev_kv = filters, prev_kv
        FakeWatch.made.append(self)

    def start(self) -> None:
        pass

    def close(self) -> None:
        self.sink.lost()


def make_view() -> tuple[JobView, list[FakeWatch]]:
    FakeWatch.made = []
    view = JobView(FakeStore([([], 1)], []), P, watch=FakeWatch)
    return view, FakeWatch.made


def test_the_view_watches_two_ranges_and_node_records_only_as_they_go():
    """Every node follows the job's attempt, end and incidents (every change) and the nodes'
    records (deletes only); no node follows the others' findings or deaths, which sort after
    ``nodes/``: only an incident's gatherer follows its reports, while it gathers."""
    view, (head, nodes) = make_view()
    ranges = [(base64.b64decode(w.key), base64.b64decode(w.range_end)) for w in (head, nodes)]
    assert ranges == [
        (P.encode(), (P + "nodes/").encode()),
        ((P + "nodes/").encode(), (P + "nodes0").encode()),
    ]
    for name in ("attempt", "final", "incidents/a0001/hang-a0001"):
        assert P + name < P + "nodes/", name
    for name in ("reports/a0001/hang-a0001/00001", "rank_deaths/00001/a0001/17"):
        assert P + name >= P + "nodes0", name
    assert (nodes.filters, nodes.prev_kv) == (("NOPUT",), True)
    assert head.filters == ()
    assert not view.live
    head.sink.reset([Entry(P + "attempt", "{}", 2)], 2)
    assert not view.live  # one watch short
    generation = view.generation
    nodes.sink.reset([Entry(P + "nodes/00001", "{}", 2)], 2)
    assert view.live and view.generation > generation
    head.sink.apply(parse(put(P + "incidents/a0001/hang-a0001", '{"node": 1}', 3)))
    assert [e.key for e in view.prefix(P + "incidents/")] == [P + "incidents/a0001/hang-a0001"]
    assert view.get(P + "attempt").value == "{}" and view.get(P + "final") is None
    assert [e.key for e in view.prefix(P + "nodes/")] == [P + "nodes/00001"]
    reports = P + "reports/a0001/hang-a0001/"
    with view.follow(reports) as followed:
        watch = FakeWatch.made[-1]
        assert (base64.b64decode(watch.key), base64.b64decode(watch.range_end)) == (
            reports.encode(),
            reports[:-1].encode() + b"0",
        )
        assert not followed.live
        watch.sink.reset([Entry(reports + "00002", "{}", 3)], 3)
        watch.sink.apply(parse(put(reports + "00001", "{}", 4)))
        assert followed.live and [e.key for e in followed.entries()] == [
            reports + "00001",
            reports + "00002",
        ]
    assert not followed.live  # closed with the block
    view.close()
    assert not view.live


def state(node: int, step: int, attempt: int = 1) -> NodeState:
    return NodeState(
        node=node, host=f"h{node}", pid=100 + node, attempt=attempt, state=RUNNING, step=step
    )


def test_a_node_gone_from_the_view_is_named_by_its_last_record():
    view, (head, nodes) = make_view()
    store = FakeStore([([], 1)], [])
    keys = JobStore(store, "j")  # type: ignore[arg-type]
    keys.view = view
    for watch in (head, nodes):
        watch.sink.reset([], 5)
    nodes.sink.reset(
        [
            Entry(P + "nodes/00000", node_json(state(0, 0)), 4),
            Entry(P + "nodes/00001", node_json(state(1, 0)), 5),
        ],
        5,
    )
    store.revisions.saw(5)
    store.revisions.saw(9)  # this node's own call, after node 1 wrote step 9 at revision 8
    assert sorted(keys.nodes(cached=True)) == [0, 1]
    # Node 1 wrote its step (unseen: the view takes no writes of nodes/), then its lease ran out.
    nodes.sink.apply(
        parse(delete(P + "nodes/00001", 11, before=node_json(state(1, 9)), before_rev=8))
    )
    found = keys.nodes(cached=True)
    assert sorted(found) == [0]
    members = Membership(keys, node=0, nnodes=2, metrics=SupervisorMetrics())
    (lost,) = members.lost(found, 1)
    assert (lost.node, lost.step, lost.host) == (1, 9, "h1")
    assert members.published_at[1] == store.revisions.at(8) is not None


def test_a_revision_is_dated_by_the_first_answer_that_showed_it():
    now = [100.0]
    clock = RevisionClock(wall=lambda: now[0], keep=3)
    assert clock.at(1) is None
    for revision in (5, 5, 7, 9):
        clock.saw(revision)
        now[0] += 1
    # 5 at 100 (and again at 101: no news), 7 at 102, 9 at 103.
    assert (clock.at(6), clock.at(7), clock.at(9), clock.at(10)) == (102.0, 102.0, 103.0, None)
    clock.saw(12)  # the oldest kept is now 7: what came before it is not known
    assert clock.at(7) is None and clock.at(8) == 103.0


def test_a_reader_waits_briefly_for_a_delete_the_watch_has_not_brought_yet():
    view, (_head, nodes) = make_view()
    key = P + "nodes/00001"
    nodes.sink.reset([Entry(key, "stale", 3)], 3)
    nodes.sink.reset([], 9)  # a reread found it gone
    slept = []

    def sleep(seconds: float) -> None:  # the delete arrives while the reader waits
        slept.append(seconds)
        nodes.sink.apply(parse(delete(key, 8, before="last", before_rev=7)))

    departed = view.departed(wait_s=1.0, sleep=sleep)
    assert {k: e.value for k, (e, _) in departed.items()} == {key: "last"} and len(slept) == 1
    assert view.departed(wait_s=1.0, sleep=sleep) == departed and len(slept) == 1, "no wait"


def test_a_delete_that_never_comes_is_waited_for_once():
    """The watch read its range again past a delete (a resync after a compaction): the reader
    waits for it once, then takes the value last seen, and never waits again."""
    view, (_head, nodes) = make_view()
    key = P + "nodes/00001"
    nodes.sink.reset([Entry(key, "last seen", 3)], 3)
    nodes.sink.reset([], 9)
    slept = []
    departed = view.departed(wait_s=0.1, sleep=slept.append)
    assert {k: e.value for k, (e, _) in departed.items()} == {key: "last seen"}
    waits = len(slept)
    assert waits >= 1 and view.departed(wait_s=0.1, sleep=slept.append) == departed
    assert len(slept) == waits, "no second wait"


def test_a_watch_told_to_reconnect_reads_its_range_again_and_follows_anew():
    """A stream cut without a word stays open and quiet: told to reconnect (another call to
    the store failed), the watch shuts it, says it is stale, reads the range again and
    watches from there, so what changed meanwhile is seen."""
    quiet = threading.Event()
    store = FakeStore(
        [([], 3), ([Entry("p/a", "2", 9)], 9)],
        [FakeStream([CREATED], quiet), FakeStream([CREATED], threading.Event())],
    )
    sink = Sink()
    watch = RangeWatch(store, key="a", range_end="b", sink=sink, retry_s=0.01)
    watch.start()
    try:
        wait_until(lambda: [c[0] for c in sink.calls] == ["reset"])
        watch.reconnect()
        wait_until(lambda: sum(c[0] == "reset" for c in sink.calls) == 2)
    finally:
        watch.close()
    assert sink.calls[:3] == [("reset", [], 3), ("lost",), ("reset", ["p/a"], 9)]
    assert store.bodies[1]["create_request"]["start_revision"] == "10"
    assert watch.connects == 2


def test_a_failed_lease_renewal_reopens_the_job_view():
    """The node's lease renewal fails (the store unreachable from here): the view stops being
    live at once, so this node reads the store (and learns of a restart elsewhere) instead of
    trusting watches a silent cut may have left open."""

    class View:
        live, reconnects = True, 0

        def reconnect(self) -> None:
            self.reconnects += 1
            self.live = False

    peers = StorePeers(
        FakeStore([([], 1)], []),  # type: ignore[arg-type]
        "j",
        SupervisorConfig(nnodes=2, node_rank=0, store_url="http://127.0.0.1:1"),
        SupervisorMetrics(),
    )
    peers.keys.node_lease, peers._renew_s = 7, 0.0
    view = View()
    peers.keys.view = view  # type: ignore[assignment]

    def keepalive(lease: int) -> bool:
        peers._stop.set()  # one renewal
        raise StoreError("etcd at http://127.0.0.1:1: timed out")

    peers.store.keepalive = keepalive  # type: ignore[method-assign]
    peers._keep_alive()
    assert view.reconnects == 1 and not view.live
