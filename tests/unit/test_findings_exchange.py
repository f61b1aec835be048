"""Many nodes detecting the same hang decide it once: the first to claim the incident (the
store's order) gathers every node's findings on a watch of that incident's reports alone and
writes its verdict; the others read no findings at all and take the verdict from their view. A
claimer lost while it gathers leaves the incident to the next claimer; a verdict that never
comes is decided alone. Fake keys and clock: no store, no sleep."""

from __future__ import annotations

from torchvitals.records.incidents import Culprit, Incident
from torchvitals.supervisor.findings_exchange import FindingsExchange
from torchvitals.supervisor.job_store import StoreOutage
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.peers import Gathered
from torchvitals.supervisor.rank_findings import NodeFindings
from torchvitals.supervisor.store_schema import RUNNING, NodeState, Verdict

KEY = "hang-a0001"


class View:
    live = True


class Followed:
    """The incident's reports as their own watch brings them."""

    def __init__(self, live: bool) -> None:
        self.live = live

    def __enter__(self) -> Followed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.live = False


class Store:
    """What every node's ``JobStore`` reads and writes: the claims and verdicts, and each
    node's findings as ``script`` says they arrive (findings by node, nodes present) at each
    look of the gathering node."""

    def __init__(self, script: list[tuple[dict[int, str], set[int]]]) -> None:
        self.script, self.looks = script, 0
        self.verdicts: dict[str, Verdict] = {}
        self.revision = 0
        self.nodes_present = {n: _running(n) for n in range(4)}


class Keys:
    """One node's ``JobStore`` over ``Store``; counts what it reads from the store itself."""

    def __init__(self, store: Store, *, followed_live: bool = True) -> None:
        self.shared, self.view = store, View()
        self.followed_live = followed_live
        self.store_reads: list[str] = []
        self.decided: list[Verdict] = []

    @property
    def live(self) -> bool:
        return self.view.live

    def put_findings(self, node: int, attempt: int, key: str, value: str) -> None:
        pass

    def claim(self, node: int, attempt: int, key: str) -> int | None:
        if key in self.shared.verdicts:
            return None
        self.shared.revision += 1
        self.shared.verdicts[key] = Verdict(node)
        return self.shared.revision

    def decide(self, attempt: int, key: str, verdict: Verdict, revision: int) -> bool:
        self.decided.append(verdict)
        self.shared.verdicts[key] = verdict
        return True

    def verdicts(self, attempt: int, *, cached: bool = False) -> dict[str, Verdict]:
        if not cached:
            self.store_reads.append("verdicts")
        return dict(self.shared.verdicts)

    def follow_findings(self, attempt: int, key: str) -> Followed:
        return Followed(self.followed_live)

    def findings(self, attempt: int, key: str, *, followed=None) -> dict[int, str]:
        if followed is None or not followed.live:
            self.store_reads.append("findings")
        shared = self.shared
        found, present = shared.script[min(shared.looks, len(shared.script) - 1)]
        shared.looks += 1
        shared.nodes_present = {n: _running(n) for n in present}
        return found

    def nodes(self, *, cached: bool = False) -> dict[int, NodeState]:
        if not cached:
            self.store_reads.append("nodes")
        return dict(self.shared.nodes_present)


class Membership:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.published_at: dict[int, float] = {}

    def nodes(self) -> dict[int, NodeState]:
        return self.keys.nodes()

    def lost(self, nodes, attempt):
        return ()


def _running(node: int) -> NodeState:
    return NodeState(node=node, host=f"h{node}", pid=100 + node, attempt=1, state=RUNNING)


def _answer(node: int) -> str:
    return NodeFindings(node=node, host=f"h{node}", key=KEY).to_json()


def _exchange(keys: Keys, clock: list[float], node: int = 0, **sleeps) -> FindingsExchange:
    config = SupervisorConfig(
        nnodes=4, node_rank=node, store_url="http://127.0.0.1:1", findings_wait_s=5.0
    )

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        if "then" in sleeps:
            sleeps["then"](clock[0])

    return FindingsExchange(
        keys,  # type: ignore[arg-type]
        Membership(keys),  # type: ignore[arg-type]
        config,
        node=node,
        outage=StoreOutage(),
        clock=lambda: clock[0],
        sleep=sleep,
    )


def _hang(gathered: Gathered) -> list[Incident]:
    """A decision on every node's findings: the last node to answer is named."""
    last = max(f.node for f in gathered.findings)
    return [
        Incident(
            kind="hang",
            key=KEY,
            step=41,
            culprit=Culprit(node=last),
            cause=f"decided on nodes {[f.node for f in gathered.findings]}",
            evidence={"nodes": len(gathered.findings)},
            detected_at=1000.0,
            attempt=1,
            writer=f"supervisor node {gathered.findings[0].node}",
        )
    ]


def _gathered(exchange: FindingsExchange, mine: NodeFindings) -> Gathered:
    """What ``exchange`` gathers as the first to claim ``mine``'s incident."""
    seen: list[Gathered] = []

    def decide(gathered: Gathered) -> list[Incident]:
        seen.append(gathered)
        return _hang(gathered)

    assert exchange.settle(1, mine, decide).by == mine.node
    (gathered,) = seen
    return gathered


def test_the_node_that_gathers_follows_the_incidents_reports_not_the_store():
    everyone = {0, 1, 2, 3}
    store = Store(
        [
            ({}, everyone),
            ({1: _answer(1)}, everyone),
            ({1: _answer(1)}, {0, 1, 2}),  # node 3's lease ran out: no longer waited for
            ({1: _answer(1), 2: _answer(2)}, {0, 1, 2}),
        ]
    )
    keys = Keys(store)
    clock = [0.0]
    gathered = _gathered(_exchange(keys, clock), NodeFindings(node=0, host="h0", key=KEY))
    assert [f.node for f in gathered.findings] == [0, 1, 2]
    assert keys.store_reads == ["nodes"], "one read of who runs the attempt, then the watches"
    assert store.looks == 4 and clock[0] < 1.0, "ended when the last running node answered"


def test_without_live_watches_each_look_reads_the_store_as_before():
    store = Store([({}, {0, 1}), ({1: _answer(1)}, {0, 1})])
    keys = Keys(store, followed_live=False)
    keys.view.live = False
    clock = [0.0]
    gathered = _gathered(_exchange(keys, clock), NodeFindings(node=0, host="h0", key=KEY))
    assert [f.node for f in gathered.findings] == [0, 1]
    assert keys.store_reads == ["nodes", "findings", "nodes", "findings", "nodes"]


def test_of_the_nodes_that_saw_one_hang_the_first_to_claim_it_decides_for_all():
    everyone = {0, 1, 2, 3}
    store = Store([({1: _answer(1), 2: _answer(2), 3: _answer(3)}, everyone)])
    first, second = Keys(store), Keys(store)
    clock = [0.0]
    settled = _exchange(first, clock, node=2).settle(
        1, NodeFindings(node=2, host="h2", key=KEY), _hang
    )
    assert settled.by == 2 and settled.incidents[0].culprit.node == 3
    assert [v.node for v in first.decided] == [2] and first.decided[0].incidents is not None
    looks = store.looks

    def never(gathered: Gathered) -> list[Incident]:
        raise AssertionError("a node that did not claim the incident decides nothing")

    taken = _exchange(second, clock, node=0).settle(
        1, NodeFindings(node=0, host="h0", key=KEY), never
    )
    assert taken.by == 2 and taken.incidents == settled.incidents
    assert store.looks == looks and "findings" not in second.store_reads, "no findings read"
    assert second.store_reads == [], "the verdict came from the view"


def test_a_waiting_node_takes_the_verdict_when_it_comes():
    store = Store([({}, {0, 1})])
    store.verdicts[KEY] = Verdict(1)  # node 1 claimed it and gathers
    keys = Keys(store)
    clock = [0.0]
    decided = _hang(Gathered([NodeFindings(node=1, host="h1", key=KEY)]))

    def then(now: float) -> None:
        if now >= 2.0:
            store.verdicts[KEY] = Verdict(1, tuple(i.to_dict() for i in decided))

    settled = _exchange(keys, clock, node=0, then=then).settle(
        1, NodeFindings(node=0, host="h0", key=KEY), _hang
    )
    assert settled.by == 1 and settled.incidents == decided
    assert 2.0 <= clock[0] < 2.5, "taken at the first look after it came"


def test_a_claimer_lost_while_it_gathers_leaves_the_incident_to_the_next():
    store = Store([({}, {0, 2}), ({2: _answer(2)}, {0, 2})])
    store.verdicts[KEY] = Verdict(1)  # node 1 claimed it, then its machine went
    keys = Keys(store)
    clock = [0.0]

    def then(now: float) -> None:
        if now >= 3.0 and store.verdicts.get(KEY) == Verdict(1):
            del store.verdicts[KEY]  # its lease expired: its claim went with it

    settled = _exchange(keys, clock, node=0, then=then).settle(
        1, NodeFindings(node=0, host="h0", key=KEY), _hang
    )
    assert settled.by == 0 and settled.incidents[0].culprit.node == 2
    assert store.verdicts[KEY].node == 0 and store.verdicts[KEY].incidents is not None


def test_a_verdict_that_never_comes_is_decided_alone_after_the_longest_gathering():
    store = Store([({}, {0, 1})])
    store.verdicts[KEY] = Verdict(1)  # claimed by a node that neither decides nor goes
    keys = Keys(store)
    clock = [0.0]
    exchange = _exchange(keys, clock, node=0)
    settled = exchange.settle(1, NodeFindings(node=0, host="h0", key=KEY), _hang, until_lost=True)
    config = exchange.config
    longest = config.findings_wait_s + config.store_poll_s + 2 * config.node_ttl_s
    assert settled.by == 0 and settled.incidents[0].cause == "decided on nodes [0]"
    assert longest <= clock[0] < longest + 0.5
