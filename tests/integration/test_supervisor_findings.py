"""Two nodes' supervisors put their findings about one incident together through a real etcd,
and name the same culprit; deaths are ordered by the store's revisions of the nodes' records of
them, not by the nodes' clocks; a lost node is named with the step the job really reached.

    python -m pytest tests/integration/test_supervisor_findings.py
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ports import free_port

from torchvitals.records.incidents import Culprit, Incident, IncidentLog
from torchvitals.supervisor.blame import blame_crash, blame_hang, union
from torchvitals.supervisor.disruptions import Disruptions
from torchvitals.supervisor.etcd import EtcdStore
from torchvitals.supervisor.localizer import Localizer
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.orders import NodesLost
from torchvitals.supervisor.peers import Gathered, Settled
from torchvitals.supervisor.rank_findings import NodeFindings, RankDeath, RankFinding
from torchvitals.supervisor.store_peers import StorePeers
from torchvitals.supervisor.store_schema import KEY_ROOT
from torchvitals.supervisor.telemetry import SupervisorMetrics

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory) -> Iterator[str]:
    binary = shutil.which("etcd")
    if binary is None:
        # A missing server fails the test (.ci/run installs it), never a silent skip.
        pytest.fail("etcd is not installed (Debian: apt-get install etcd-server)")
    folder = tmp_path_factory.mktemp("etcd")
    url, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    with open(folder / "etcd.log", "w") as out:
        proc = subprocess.Popen(
            [
                binary,
                "--data-dir",
                str(folder / "data"),
                "--listen-client-urls",
                url,
                "--advertise-client-urls",
                url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"default={peer}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError((folder / "etcd.log").read_text()[-2000:]) from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def running_nodes(url: str, job: str, count: int = 2, **config) -> list[StorePeers]:
    """``count`` nodes' peers, joined, through the barrier, running attempt 1."""
    nodes = [
        StorePeers(
            EtcdStore(url),
            job,
            SupervisorConfig(
                store_url=url,
                nnodes=count,
                node_rank=n,
                node_ttl_s=3,
                store_poll_s=0.1,
                peer_timeout_s=20,
                **config,
            ),
            SupervisorMetrics(),
        )
        for n in range(count)
    ]
    for node in nodes:
        node.join()
    waiters = [threading.Thread(target=n.wait_for_peers, args=(1,)) for n in nodes[1:]]
    for waiter in waiters:
        waiter.start()
    nodes[0].wait_for_peers(1)
    for waiter in waiters:
        waiter.join(20)
    for node in nodes:
        node.started(1)
    return nodes


def gathered_by(
    node: StorePeers, mine: NodeFindings, *, until_lost: bool = False
) -> tuple[Gathered | None, Settled]:
    """``node`` settles ``mine``'s incident: what it gathered (None: it took another node's
    verdict), and the verdict (the rules' culprit)."""
    seen: list[Gathered] = []

    def decide(gathered: Gathered) -> list[Incident]:
        seen.append(gathered)
        ranks, deaths = union(gathered.findings)
        blame = blame_crash(deaths) if mine.key.startswith("crash") else blame_hang(ranks)
        return [
            Incident(
                kind=mine.key.split("-", 1)[0],
                key=mine.key,
                step=41,
                culprit=Culprit(node=mine.node) if blame is None else blame.culprit,
                cause=f"decided on nodes {[f.node for f in gathered.findings]}",
                detected_at=time.time(),
                attempt=1,
                writer=f"supervisor node {node.me.node}",
            )
        ]

    settled = node.settle(1, mine, decide, until_lost=until_lost)
    return (seen[0] if seen else None), settled


def finding(rank: int, node: int, state: str, waiting: bool | None, frame: str | None):
    return RankFinding(
        rank=rank,
        node=node,
        host=f"host{node}",
        pid=100 + rank,
        step=41,
        beat_time=1.0,
        state=state,
        asked=state != "T",
        waiting=waiting,
        frame=frame,
    )


NODE0 = NodeFindings(
    node=0,
    host="host0",
    key="hang-a0001",
    ranks=(
        finding(0, 0, "S", True, "all_reduce"),
        finding(1, 0, "S", True, "all_reduce"),
    ),
)
NODE1 = NodeFindings(
    node=1,
    host="host1",
    key="hang-a0001",
    ranks=(finding(2, 1, "T", None, None), finding(3, 1, "S", True, "all_reduce")),
)


def test_the_node_that_saw_the_hang_waits_for_the_others_findings_and_both_name_one_culprit(
    etcd_url,
):
    nodes = running_nodes(etcd_url, f"hang-{uuid.uuid4().hex[:8]}", findings_wait_s=10)
    answered = threading.Event()

    def other_node() -> None:  # node 1's watch loop: it answers at its next store poll
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for key in nodes[1].wanted(1):
                assert key == "hang-a0001"
                nodes[1].answer(1, NODE1)
                answered.set()
                return
            time.sleep(0.05)

    helper = threading.Thread(target=other_node)
    try:
        helper.start()
        started = time.monotonic()
        every, settled = gathered_by(nodes[0], NODE0)
        took = time.monotonic() - started
        helper.join(10)
        assert answered.is_set() and took < 5, took  # not the whole findings_wait_s
        assert every is not None and [f.node for f in every.findings] == [0, 1]
        ranks, _ = union(every.findings)
        blame = blame_hang(ranks)
        assert (blame.culprit.rank, blame.culprit.node) == (2, 1)
        assert settled.by == 0 and settled.incidents[0].culprit == blame.culprit
        # Node 1 sees the hang too, later: it takes node 0's verdict, deciding nothing itself.
        mine, again = gathered_by(nodes[1], NODE1)
        assert mine is None and again.by == 0 and again.incidents == settled.incidents
        assert nodes[1].wanted(1, now=True) == ()  # answered, and decided: not asked again
    finally:
        for node in nodes:
            node.close()


def test_many_nodes_that_saw_one_hang_decide_it_once_and_only_the_decider_reads_findings(
    etcd_url,
):
    """Four nodes detect the same hang at once. The first to claim it (the store's order)
    gathers every node's findings on a watch of that incident's reports and decides; the three
    others read no findings at all and take its verdict, which names the same culprit."""
    job = f"many-{uuid.uuid4().hex[:8]}"
    nodes = running_nodes(etcd_url, job, count=4, findings_wait_s=10)
    reports = f"{KEY_ROOT}{job}/reports/"
    reads: dict[int, list[str]] = {n: [] for n in range(4)}
    for n, node in enumerate(nodes):
        call = node.store._call

        def counted(path, body, n=n, call=call):
            key = base64.b64decode(body.get("key", "")).decode()
            if path == "/v3/kv/range" and key.startswith(reports):
                reads[n].append(key)
            return call(path, body)

        node.store._call = counted  # type: ignore[method-assign]
    mine = [
        NodeFindings(
            node=n,
            host=f"host{n}",
            key="hang-a0001",
            ranks=(
                finding(2 * n, n, "T" if n == 2 else "S", None if n == 2 else True, None),
                finding(2 * n + 1, n, "S", True, "all_reduce"),
            ),
        )
        for n in range(4)
    ]
    decided: dict[int, list[int]] = {n: [] for n in range(4)}
    settled: dict[int, Settled] = {}

    def decide_on(n: int):
        def decide(gathered: Gathered) -> list[Incident]:
            decided[n].append(len(gathered.findings))
            blame = blame_hang(union(gathered.findings)[0])
            return [
                Incident(
                    kind="hang",
                    key="hang-a0001",
                    step=41,
                    culprit=blame.culprit,
                    cause=blame.cause,
                    evidence=blame.evidence,
                    detected_at=time.time(),
                    attempt=1,
                    writer=f"supervisor node {n}",
                )
            ]

        return decide

    def detect(n: int) -> None:
        settled[n] = nodes[n].settle(1, mine[n], decide_on(n), until_lost=True)

    threads = [threading.Thread(target=detect, args=(n,)) for n in range(4)]
    try:
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert time.monotonic() - started < 5, "every node answered: no findings_wait_s"
        assert sorted(settled) == [0, 1, 2, 3]
        (by,) = {s.by for s in settled.values()}
        assert [n for n in range(4) if decided[n]] == [by] and decided[by] == [4]
        incidents = {json.dumps(s.incidents[0].to_dict(), sort_keys=True) for s in settled.values()}
        assert len(incidents) == 1, "one verdict, taken as it is"
        culprit = settled[by].incidents[0].culprit
        assert (culprit.rank, culprit.node) == (4, 2)  # the stopped rank
        assert all(not reads[n] for n in range(4) if n != by), reads  # no findings read
        assert nodes[by].asked(1) == frozenset({"hang-a0001"})
    finally:
        for node in nodes:
            node.close()


def test_a_node_that_does_not_answer_is_decided_without_after_findings_wait_s(etcd_url):
    job = f"silent-{uuid.uuid4().hex[:8]}"
    nodes = running_nodes(etcd_url, job, findings_wait_s=1.5)
    store = EtcdStore(etcd_url)
    try:
        crash = NodeFindings(
            node=0,
            host="host0",
            key="crash-a0001",
            deaths=(RankDeath(rank=1, node=0, host="host0", pid=101, at=5.0, status=13),),
        )
        started = time.monotonic()
        every, _ = gathered_by(nodes[0], crash)
        assert 1.5 <= time.monotonic() - started < 4
        assert every is not None
        blame = blame_crash(union(every.findings)[1])
        assert blame is not None and blame.culprit.rank == 1
        names = {e.key[len(KEY_ROOT + job) + 1 :] for e in store.prefix(f"{KEY_ROOT}{job}/")}
        assert {"reports/a0001/crash-a0001/00000", "incidents/a0001/crash-a0001"} <= names
        # The next attempt starts: this node's findings and claims of the old one are gone.
        nodes[0].started(2)
        names = {e.key[len(KEY_ROOT + job) + 1 :] for e in store.prefix(f"{KEY_ROOT}{job}/")}
        assert not {n for n in names if n.startswith(("reports/a0001", "incidents/a0001"))}
    finally:
        for node in nodes:
            node.close()


def test_deaths_are_ordered_by_the_stores_revisions_not_by_the_nodes_clocks(etcd_url):
    job = f"order-{uuid.uuid4().hex[:8]}"
    nodes = running_nodes(etcd_url, job)
    store = EtcdStore(etcd_url)
    try:
        # Node 0's rank 0 exits 13; node 1's rank 2 dies of it 40 ms later. Each supervisor
        # records its death the moment it sees it; node 1's clock runs 30 s behind node 0's.
        first = nodes[0].mark_death(1, 100, 0, 13)
        second = nodes[1].mark_death(1, 200, 2, 1)
        assert first is not None and second is not None and first < second
        deaths = [
            NodeFindings(
                node=0,
                host="host0",
                key="crash-a0001",
                deaths=(
                    RankDeath(
                        rank=0, node=0, host="host0", pid=100, at=1000.0, status=13, revision=first
                    ),
                ),
            ),
            NodeFindings(
                node=1,
                host="host1",
                key="crash-a0001",
                deaths=(
                    RankDeath(
                        rank=2, node=1, host="host1", pid=200, at=970.04, status=1, revision=second
                    ),
                ),
            ),
        ]
        blame = blame_crash(union(deaths)[1])
        assert blame is not None and (blame.culprit.rank, blame.culprit.node) == (0, 0)
        # The records are the store's revisions of these keys, and go with the next attempt.
        entries = {e.key[len(KEY_ROOT + job) + 1 :]: e for e in store.prefix(f"{KEY_ROOT}{job}/")}
        assert entries["rank_deaths/00000/a0001/100"].mod_revision == first
        assert entries["rank_deaths/00001/a0001/200"].mod_revision == second
        nodes[0].started(2)
        names = {e.key[len(KEY_ROOT + job) + 1 :] for e in store.prefix(f"{KEY_ROOT}{job}/")}
        assert not {n for n in names if n.startswith("rank_deaths/00000")}
        assert "rank_deaths/00001/a0001/200" in names  # node 1's own go at its own start
    finally:
        for node in nodes:
            node.close()


def test_a_lost_node_is_named_at_the_step_the_survivors_reached(etcd_url, tmp_path):
    nodes = running_nodes(etcd_url, f"lost-{uuid.uuid4().hex[:8]}")
    try:
        # Node 1 publishes step 9 (a lease renewal after its start: node_ttl_s / 3 = 1 s); its
        # next steps are not written before the next renewal.
        time.sleep(1.1)
        assert nodes[1].watch(1, 9) is None
        time.sleep(0.2)
        assert nodes[0].watch(1, 9) is None
        for step in range(10, 26):
            time.sleep(0.02)
            nodes[1].watch(1, step)
        # Node 1's machine is gone: its lease revoked at once (the keeper stops renewing).
        nodes[1]._stop.set()
        nodes[1].store.revoke(nodes[1].keys.node_lease)
        order = None
        deadline = time.monotonic() + 10
        while order is None and time.monotonic() < deadline:
            time.sleep(0.15)
            order = nodes[0].watch(1, 25)
        assert isinstance(order, NodesLost), order
        assert order.step == 25 and [s.step for s in order.lost] == [9]
        assert "lost at step 25 (it last published step 9, " in order.reason
        assert "this node's ranks are at step 25" in order.reason
        metrics = SupervisorMetrics()
        book = Disruptions(tmp_path, node=0, host="host0", metrics=metrics)
        localizer = Localizer(nodes[0].config, nodes[0], book, node=0, host="host0")
        (incident,) = localizer.lost(1, order, detected_at=time.time(), last_advance=time.time())
        assert incident.key == "node_lost-a0001-n1" and incident.step == 25
        assert (incident.culprit.node, incident.culprit.rank) == (1, None)
        assert incident.evidence["last_published_step"] == 9
        assert incident.evidence["survivor_step"] == 25
        assert IncidentLog(tmp_path).get("node_lost-a0001-n1") == incident
        book.recovered(at=incident.detected_at + 30)
        assert IncidentLog(tmp_path).get("node_lost-a0001-n1").recovered_at is not None
        labels = {"kind": "node_lost", "rank": "", "node": "1", "host": incident.culprit.host}
        assert (
            metrics.registry.get_sample_value("torchvitals_supervisor_incidents_total", labels) == 1
        )
    finally:
        nodes[0].close()
        nodes[1].close()


@pytest.mark.parametrize("gone", ["expiring", "expired"])
def test_a_crash_whose_other_node_is_gone_is_that_nodes_loss(etcd_url, gone):
    # Node 1's machine dies; node 0's ranks die of their failed collectives (exit 1), and node 0
    # asks node 1 for its findings: it never answers, its lease runs out (or already had): the
    # node is the cause.
    nodes = running_nodes(etcd_url, f"gone-{uuid.uuid4().hex[:8]}", findings_wait_s=0.5)
    try:
        time.sleep(1.1)  # a lease renewal: node 1's step is published
        nodes[1].watch(1, 14)
        time.sleep(0.2)
        nodes[0].watch(1, 14)
        nodes[1]._stop.set()  # its keeper stops renewing: the lease runs out within 3 s
        if gone == "expired":
            nodes[1].store.revoke(nodes[1].keys.node_lease)
        mine = NodeFindings(
            node=0,
            host="host0",
            key="crash-a0001",
            deaths=(RankDeath(rank=0, node=0, host="host0", pid=100, at=5.0, status=1),),
        )
        started = time.monotonic()
        gathered, _ = gathered_by(nodes[0], mine, until_lost=True)
        assert time.monotonic() - started < 0.5 + 3 + 1.5
        assert gathered is not None
        assert [s.node for s in gathered.lost] == [1] and gathered.lost[0].step == 14
        assert [f.node for f in gathered.findings] == [0]
    finally:
        nodes[0].close()
        nodes[1].close()


def test_only_the_first_writer_of_an_incident_counts_it(tmp_path):
    metrics = [SupervisorMetrics(), SupervisorMetrics()]
    books = [Disruptions(Path(tmp_path), node=n, host="h", metrics=metrics[n]) for n in (0, 1)]
    incident = Incident(
        kind="hang",
        key="hang-a0003",
        step=7,
        culprit=Culprit(rank=3, node=1, host="h", pid=9),
        cause="rank 3 is stopped (SIGSTOP)",
        detected_at=100.0,
    )
    assert books[0].record(incident, last_advance=95.0)
    assert not books[1].record(incident, last_advance=96.0)
    books[1].recovered(at=130.0)  # not its incident: nothing to update
    assert IncidentLog(tmp_path).get("hang-a0003").recovered_at is None
    books[0].recovered(at=130.0)
    updated = IncidentLog(tmp_path).get("hang-a0003")
    assert (updated.recovered_at, updated.lost_seconds) == (130.0, 35.0)
    labels = {"kind": "hang", "rank": "3", "node": "1", "host": "h"}
    counts = [
        m.registry.get_sample_value("torchvitals_supervisor_incidents_total", labels)
        for m in metrics
    ]
    assert counts == [1, None]  # the sum over the nodes counts it once
