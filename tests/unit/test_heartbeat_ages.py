"""A rank's heartbeat age is measured on its own host (its clock when it wrote, its supervisor's
when it looked), and a node answering another node's ask publishes the ages as of the moment it
saw the ask: what the nodes compare are durations counted from one moment, never two hosts'
unix times. Fake clocks, fake pids (gone: no signal is sent), a fake store.

python -m pytest tests/unit/test_heartbeat_ages.py
"""

from __future__ import annotations

from collections import deque

from torchvitals.protocol import (
    TRAIN,
    combine_beats,
    heartbeat_path,
    read_rank_beats,
    write_heartbeat,
)
from torchvitals.supervisor.disruptions import Disruptions
from torchvitals.supervisor.hang_clock import HangClock
from torchvitals.supervisor.localizer import Localizer
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.peers import Gathered, Settled, SoloPeers
from torchvitals.supervisor.rank_findings import NodeFindings
from torchvitals.supervisor.rank_probe import probe_ranks
from torchvitals.supervisor.store_schema import NodeState
from torchvitals.supervisor.telemetry import SupervisorMetrics
from torchvitals.supervisor.witness import Witness

SKEW_S = 30.0
"""This host's clock against the other node's: whatever it is, the ages do not change."""
GONE_PID = 2**22 + 21


def beats(folder, written: dict[int, tuple[int, float]]) -> None:
    for rank, (step, at) in written.items():
        write_heartbeat(
            heartbeat_path(folder, rank), step=step, time=at, phase=TRAIN, pid=GONE_PID, rank=rank
        )


def test_an_age_is_the_hosts_own_clock_against_itself(tmp_path):
    # This host's clock runs 30 s ahead: its ranks wrote 30 s "later", its supervisor reads 30 s
    # "later"; the ages are the same as on a host whose clock is right.
    for skew in (0.0, SKEW_S, -SKEW_S):
        beats(tmp_path, {0: (41, 1000.0 + skew), 1: (37, 990.0 + skew)})
        found = probe_ranks(tmp_path, node=1, host="h1", wait_s=0, wall=lambda s=skew: 1008 + s)
        assert [(r.rank, r.step, r.beat_age_s) for r in found] == [(0, 41, 8.0), (1, 37, 18.0)]
        assert [r.beat_time for r in found] == [1000.0 + skew, 990.0 + skew]  # for people


class Asked(SoloPeers):
    """Another node asked for the findings of ``hang-a0001``; what this node answers."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[NodeFindings] = []

    def wanted(self, attempt: int, *, now: bool = False) -> tuple[str, ...]:
        return ("hang-a0001",)

    def answer(self, attempt: int, mine: NodeFindings) -> None:
        self.answers.append(mine)


def test_a_node_answers_with_its_ages_as_of_the_moment_it_saw_the_ask(tmp_path):
    beats(tmp_path, {2: (41, 1000.0), 3: (37, 990.0)})
    config = SupervisorConfig(nnodes=2, node_rank=1, store_url="http://127.0.0.1:1")
    peers = Asked()
    book = Disruptions(tmp_path / "job", node=1, host="h1", metrics=SupervisorMetrics())
    # The ask is seen at monotonic 50.0; the heartbeats are read 1.5 s later (a slow probe), at
    # unix 1008.0 on this host.
    localizer = Localizer(config, peers, book, node=1, host="h1", clock=lambda: 50.0)
    witness = Witness(
        tmp_path,
        node=1,
        host="h1",
        stderr=None,
        probe_wait_s=0,
        wall=lambda: 1008.0,
        clock=lambda: 51.5,
    )
    try:
        localizer.answer(1, witness)
    finally:
        witness.close(0)
        book.close()
    (sent,) = peers.answers
    assert [(r.rank, r.beat_age_s) for r in sent.ranks] == [(2, 6.5), (3, 16.5)]
    assert sent.taken_at is None  # published as of the ask: no host's monotonic time leaves it
    assert NodeFindings.from_json(sent.to_json()).ranks == sent.ranks


class LostMeanwhile(SoloPeers):
    """Node 0 never answers the ask: its lease expired while this node waited for it."""

    def __init__(self) -> None:
        super().__init__()
        self.until_lost: list[bool] = []

    def settle(self, attempt, mine, decide, *, until_lost=False):
        self.until_lost.append(until_lost)
        lost = NodeState(node=0, host="h0", pid=7, attempt=attempt, state="running", step=39)
        return Settled(decide(Gathered([mine], (lost,), (990.0,))), mine.node)


def test_a_hang_whose_cause_is_a_lost_node_is_that_nodes_loss(tmp_path):
    """This node's ranks hang in their collectives because node 0 died; whichever fires first
    here (the hang timeout or the lost lease), the record names node 0 as lost, at the step
    this node's ranks reached, not a hang with no culprit."""
    beats(tmp_path, {2: (41, 1000.0), 3: (41, 1000.0)})
    config = SupervisorConfig(nnodes=2, node_rank=1, store_url="http://127.0.0.1:1")
    peers = LostMeanwhile()
    book = Disruptions(tmp_path / "job", node=1, host="h1", metrics=SupervisorMetrics())
    localizer = Localizer(config, peers, book, node=1, host="h1", clock=lambda: 50.0)
    witness = Witness(tmp_path, node=1, host="h1", stderr=None, probe_wait_s=0, wall=lambda: 1100.0)
    clock = HangClock(config, deque(), 0.0)
    clock.observe(combine_beats(read_rank_beats(tmp_path)), 1.0)
    try:
        incident = localizer.hang(1, "hang-a0001", witness, clock=clock, detected_at=1100.0)
    finally:
        witness.close(0)
        book.close()
    assert peers.until_lost == [True]
    assert incident.kind == "node_lost" and incident.culprit.node == 0
    assert incident.step == 41 and incident.evidence["last_published_step"] == 39
    assert "hung waiting for its ranks (hang-a0001)" in incident.cause
