"""Many nodes detecting the same hang wait for each other's findings on their watches: while
the job's view is live a gathering node reads who runs the attempt once, then only its view
(no store read per look), stops waiting for a node whose lease ran out, and ends as soon as
every running node answered. Fake keys and clock: no store, no sleep."""

from __future__ import annotations

from torchvitals.supervisor.findings_exchange import FindingsExchange
from torchvitals.supervisor.job_store import StoreOutage
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.rank_findings import NodeFindings
from torchvitals.supervisor.store_schema import RUNNING, NodeState

KEY = "hang-a0001"


class View:
    live = True


class Keys:
    """The job's keys as ``JobStore`` serves them; ``script`` says what the view holds at each
    look (findings by node, nodes present)."""

    def __init__(self, script: list[tuple[dict[int, str], set[int]]]) -> None:
        self.view = View()
        self.script, self.looks = script, 0
        self.store_reads: list[str] = []
        self.nodes_present = {n: _running(n) for n in range(4)}

    def put_findings(self, node: int, attempt: int, key: str, value: str) -> None:
        pass

    def want(self, node: int, attempt: int, key: str) -> None:
        pass

    def findings(self, attempt: int, key: str, *, cached: bool = False) -> dict[int, str]:
        if not cached:
            self.store_reads.append("findings")
        found, present = self.script[min(self.looks, len(self.script) - 1)]
        self.looks += 1
        self.nodes_present = {n: _running(n) for n in present}
        return found

    def nodes(self, *, cached: bool = False) -> dict[int, NodeState]:
        if not cached:
            self.store_reads.append("nodes")
        return dict(self.nodes_present)


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


def _exchange(keys: Keys, clock: list[float]) -> FindingsExchange:
    config = SupervisorConfig(
        nnodes=4, node_rank=0, store_url="http://127.0.0.1:1", findings_wait_s=5.0
    )

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    return FindingsExchange(
        keys,  # type: ignore[arg-type]
        Membership(keys),  # type: ignore[arg-type]
        config,
        node=0,
        outage=StoreOutage(),
        clock=lambda: clock[0],
        sleep=sleep,
    )


def test_the_nodes_that_detected_a_hang_wait_on_their_view_not_on_the_store():
    everyone = {0, 1, 2, 3}
    keys = Keys(
        [
            ({}, everyone),
            ({1: _answer(1)}, everyone),
            ({1: _answer(1)}, {0, 1, 2}),  # node 3's lease ran out: no longer waited for
            ({1: _answer(1), 2: _answer(2)}, {0, 1, 2}),
        ]
    )
    clock = [0.0]
    gathered = _exchange(keys, clock).gather(1, NodeFindings(node=0, host="h0", key=KEY))
    assert [f.node for f in gathered.findings] == [0, 1, 2]
    assert keys.store_reads == ["nodes"], "one read of who runs the attempt, then the view"
    assert keys.looks == 4 and clock[0] < 1.0, "ended when the last running node answered"


def test_without_a_live_view_each_look_reads_the_store_as_before():
    keys = Keys([({}, {0, 1}), ({1: _answer(1)}, {0, 1})])
    keys.view.live = False
    clock = [0.0]
    gathered = _exchange(keys, clock).gather(1, NodeFindings(node=0, host="h0", key=KEY))
    assert [f.node for f in gathered.findings] == [0, 1]
    assert keys.store_reads == ["nodes", "findings", "nodes", "findings", "nodes"]
