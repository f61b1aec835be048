"""Naming the culprit of a hang or a crash from every node's findings: the rules in order
(stopped, gone, spinning, silent, behind, none), the first death across nodes, the stacks as
faulthandler writes them, and the findings' round trip through the store's JSON. Nodes whose
clocks are 30 s apart name the same culprit as nodes whose clocks agree: the order comes from
the store's revisions, step numbers and each host's own durations.

python -m pytest tests/unit/test_blame.py
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import threading

import pytest

from torchvitals.supervisor.blame import blame_crash, blame_hang, union
from torchvitals.supervisor.rank_findings import (
    STACK_EXCERPT_CHARS,
    NodeFindings,
    RankDeath,
    RankFinding,
)
from torchvitals.supervisor.rank_probe import parse_stack

# A gloo rank blocked in all_reduce while its peer spins, dumped by faulthandler on the stack
# signal (torch 2.13, Python 3.11): the strings the supervisor reads.
WAITING = """\
Current thread 0x00007f71cac0ab80 (most recent call first):
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/tmp/fh/r.py", line 13 in <module>
"""  # noqa: E501
SPINNING = """\
Current thread 0x00007f57d001cb80 (most recent call first):
  File "/tmp/fh/r.py", line 10 in spin
  File "/tmp/fh/r.py", line 12 in <module>
"""


def rank(r: int, node: int | None = None, **fields) -> RankFinding:
    """Rank ``r`` of a 2-rank-per-node job, waiting in all_reduce at step 41 unless told."""
    stack = fields.pop("stack_text", WAITING)
    frames, waiting, frame = parse_stack(stack)
    values = {
        "rank": r,
        "node": r // 2 if node is None else node,
        "host": f"host{r // 2}",
        "pid": 1000 + r,
        "step": 41,
        "beat_time": 100.0,
        "beat_age_s": 8.0,
        "state": "S",
        "asked": True,
        "stack": "\n".join(f'File "{f}", line {n} in {fn}' for f, n, fn in frames),
        "waiting": waiting,
        "frame": frame,
    }
    values.update(fields)
    return RankFinding(**values)


def test_the_stacks_say_who_waits_in_a_collective_and_who_runs_user_code():
    frames, waiting, frame = parse_stack(WAITING)
    assert waiting is True and frames[0][2] == "all_reduce"
    assert frame.startswith('File "/root/.pyenv/') and frame.endswith("line 3252 in all_reduce")
    frames, waiting, frame = parse_stack(SPINNING)
    assert waiting is False and frame == 'File "/tmp/fh/r.py", line 10 in spin'
    assert parse_stack("") == ([], None, None)


def test_the_training_thread_is_read_among_every_thread_of_a_real_dump(tmp_path):
    # A real dump of this process: a helper thread parked in Event.wait beside the main one.
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, daemon=True)
    helper.start()
    path = tmp_path / "stack.txt"
    try:
        with open(path, "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
    finally:
        stop.set()
    frames, waiting, frame = parse_stack(path.read_text())
    # The main thread (pytest's, started as a module) runs this test; the helper's threading
    # frames are not taken for it.
    assert waiting is False
    assert any(
        fn == "test_the_training_thread_is_read_among_every_thread_of_a_real_dump"
        for _, _, fn in frames
    )
    assert "test_blame.py" in frame


def test_a_stopped_rank_is_the_culprit_before_anything_else():
    ranks = [
        rank(0),
        rank(1),
        rank(2, state="T", asked=False, stack="", waiting=None, frame=None),
        rank(3, stack_text=SPINNING),
    ]
    blame = blame_hang(ranks)
    assert blame.rule == "stopped"
    assert (blame.culprit.rank, blame.culprit.node, blame.culprit.pid) == (2, 1, 1002)
    assert blame.cause == "rank 2 (node 1, host host1, pid 1002) is stopped (SIGSTOP)"
    assert blame.evidence["state"] == "T"
    assert [r["state"] for r in blame.evidence["ranks"]] == ["S", "S", "T", "S"]


def test_a_rank_spinning_in_user_code_while_the_others_wait_is_the_culprit_with_its_frame():
    blame = blame_hang([rank(0), rank(1, stack_text=SPINNING), rank(2), rank(3)])
    assert blame.rule == "spinning" and blame.culprit.rank == 1
    assert blame.evidence["frame"] == 'File "/tmp/fh/r.py", line 10 in spin'
    assert 'runs File "/tmp/fh/r.py", line 10 in spin while ranks 0, 2, 3 wait in' in blame.cause
    solo = blame_hang([rank(0, stack_text=SPINNING), rank(1)])
    assert solo.cause.endswith("while rank 1 waits in one")
    assert blame.evidence["waiting"] == [0, 2, 3]


def test_a_rank_that_does_not_answer_while_the_others_wait_is_named_silent():
    quiet = rank(3, state="D", stack="", waiting=None, frame=None)
    blame = blame_hang([rank(0), rank(1), rank(2), quiet])
    assert (blame.rule, blame.culprit.rank) == ("silent", 3)
    assert "state D" in blame.cause


def test_a_gone_rank_is_named_while_the_others_still_run():
    gone = rank(1, state="gone", asked=False, stack="", waiting=None, frame=None)
    assert (blame_hang([rank(0), gone]).rule, blame_hang([rank(0), gone]).culprit.rank) == (
        "gone",
        1,
    )
    # Every process gone (a restart that hangs before its first heartbeat): nobody to name.
    everyone = [rank(r, state="gone", asked=False, stack="", waiting=None) for r in range(2)]
    blame = blame_hang(everyone)
    assert blame.rule == "none" and blame.culprit.rank is None


SKEWS = [0.0, 30.0, -30.0]
"""Node 1's clock against node 0's: agreeing, 30 s ahead, 30 s behind."""


@pytest.mark.parametrize("skew", SKEWS)
def test_without_stacks_the_rank_whose_heartbeat_stopped_long_before_is_behind(skew):
    # Ranks 0 and 1 run on node 0, rank 2 on node 1, whose clock is ``skew`` off: the unix times
    # its rank wrote are off by as much, the ages (one host's clock against itself) are not.
    blind = {"stack": "", "waiting": None, "frame": None, "asked": False}
    ranks = [
        rank(0, node=0, step=41, beat_time=100.0, beat_age_s=8.0, **blind),
        rank(1, node=0, step=37, beat_time=90.0, beat_age_s=18.0, **blind),
        rank(2, node=1, step=41, beat_time=100.0 + skew, beat_age_s=8.0, **blind),
    ]
    blame = blame_hang(ranks)
    assert (blame.rule, blame.culprit.rank) == ("behind", 1)
    assert "step 37, 10 s older than the others' (step 41)" in blame.cause
    # The same hang seen from node 1's side, its rank the one behind.
    ranks = [
        rank(0, node=0, step=41, beat_time=100.0, beat_age_s=8.0, **blind),
        rank(2, node=1, step=37, beat_time=90.0 + skew, beat_age_s=18.0, **blind),
    ]
    assert (blame_hang(ranks).rule, blame_hang(ranks).culprit.rank) == ("behind", 2)
    # A lower step written within the slack of the others' says nothing, whatever the clocks
    # say: the agents write at most once a second, so a fast job's files lag by a step or more.
    close = [
        rank(0, node=0, step=41, beat_age_s=8.0, **blind),
        rank(2, node=1, step=40, beat_time=99.5 - abs(skew), beat_age_s=9.5, **blind),
    ]
    assert blame_hang(close).rule == "none"
    # The slack widens with the moments apart at which the nodes took their ages.
    assert blame_hang(close, slack_s=1.0).culprit.rank == 2
    # A rank whose age is unknown is not judged.
    unknown = [rank(0, step=41, **blind), rank(1, step=37, beat_age_s=None, **blind)]
    assert blame_hang(unknown).rule == "none"


def test_heartbeat_ages_travel_as_of_the_moment_the_nodes_share():
    # Node 1 took its ages at its monotonic 500.0 and saw node 0's ask at 499.2 (its probe ran
    # after): its ages count to the ask. Node 0 took its own at 10.0 and asked at 11.5 (its
    # stacks took 1.5 s): its ages count to its ask. Monotonic times never leave their host.
    seen = node_findings(1, ranks=(rank(2, beat_age_s=9.0), rank(3, beat_age_s=2.0)))
    seen = NodeFindings(**{**vars(seen), "taken_at": 500.0})
    back = NodeFindings.from_json(seen.as_of(499.2).to_json())
    assert [r.beat_age_s for r in back.ranks] == [pytest.approx(8.2), pytest.approx(1.2)]
    assert back.taken_at is None and "taken_at" not in seen.to_json()
    asked = node_findings(0, ranks=(rank(0, beat_age_s=0.5),))
    asked = NodeFindings(**{**vars(asked), "taken_at": 10.0})
    assert asked.as_of(11.5).ranks[0].beat_age_s == pytest.approx(2.0)
    # Published once: already as of the shared moment, no second shift.
    assert asked.as_of(11.5).as_of(99.0).ranks[0].beat_age_s == pytest.approx(2.0)
    # A rank that progressed between the ask and the look counts from the ask: age 0.
    assert seen.as_of(400.0).ranks[1].beat_age_s == 0.0


def test_when_every_rank_waits_alike_no_culprit_is_named():
    blame = blame_hang([rank(r) for r in range(4)])
    assert blame.rule == "none" and blame.culprit.rank is None and blame.culprit.node is None
    assert blame.cause == "no rank stands out: every rank waits in a collective (step 41)"
    assert len(blame.evidence["ranks"]) == 4


def node_findings(node: int, key: str = "hang-a0002", **parts) -> NodeFindings:
    return NodeFindings(node=node, host=f"host{node}", key=key, **parts)


def test_every_node_names_the_same_culprit_whatever_order_the_findings_come_in():
    nodes = [
        node_findings(0, ranks=(rank(0), rank(1))),
        node_findings(1, ranks=(rank(2, stack_text=SPINNING), rank(3))),
    ]
    blames = set()
    for order in itertools.permutations(nodes):
        ranks, _ = union([NodeFindings.from_json(n.to_json()) for n in order])
        blame = blame_hang(ranks)
        blames.add((blame.culprit, blame.cause))
    assert blames == {
        (
            blame_hang([rank(0), rank(1), rank(2, stack_text=SPINNING), rank(3)]).culprit,
            "rank 2 (node 1, host host1, pid 1002) is not in a collective: it runs File "
            '"/tmp/fh/r.py", line 10 in spin while ranks 0, 1, 3 wait in one',
        )
    }


def test_findings_travel_bounded_and_are_refused_when_they_are_not_findings():
    long = rank(0, stack="x" * 10_000)
    back = NodeFindings.from_json(node_findings(0, ranks=(long,)).to_json())
    assert len(back.ranks[0].stack) == STACK_EXCERPT_CHARS
    assert back.ranks[0].summary() == long.summary()
    with pytest.raises(ValueError, match="node"):
        NodeFindings.from_json('{"node": "zero", "host": "h", "key": "k"}')
    with pytest.raises(ValueError, match="ranks"):
        NodeFindings.from_json('{"node": 0, "host": "h", "key": "k", "ranks": {"a": 1}}')
    with pytest.raises(ValueError, match="rank"):
        NodeFindings.from_json('{"node": 0, "host": "h", "key": "k", "ranks": [{"rank": true}]}')


def death(
    rank: int | None,
    node: int,
    at: float,
    status: int | None,
    pid: int = 0,
    revision: int | None = None,
) -> RankDeath:
    return RankDeath(
        rank=rank,
        node=node,
        host=f"host{node}",
        pid=pid or 2000 + node,
        at=at,
        status=status,
        revision=revision,
    )


@pytest.mark.parametrize("skew", SKEWS)
def test_the_first_death_across_nodes_is_the_first_the_store_recorded_whatever_the_clocks(skew):
    # Rank 2 (node 1) exited 13; torchrun stopped rank 3 a few ms later; node 0's ranks died of
    # the broken collective after that. Each node recorded each death in the store the moment
    # it saw it (the revisions); node 1's clock is ``skew`` off node 0's, so its unix times are
    # too: 30 s behind, its deaths look 30 s earlier than node 0's, 30 s ahead, 30 s later.
    nodes = [
        node_findings(
            0,
            "crash-a0001",
            deaths=(death(0, 0, 50.30, 1, 10, 104), death(1, 0, 50.31, 1, 11, 105)),
        ),
        node_findings(
            1,
            "crash-a0001",
            deaths=(
                death(3, 1, 50.21 + skew, -15, 13, 103),
                death(2, 1, 50.20 + skew, 13, 12, 101),
            ),
        ),
    ]
    for order in itertools.permutations(nodes):
        _, deaths = union([NodeFindings.from_json(n.to_json()) for n in order])
        blame = blame_crash(deaths)
        assert blame is not None
        assert (blame.culprit.rank, blame.culprit.node, blame.culprit.pid) == (2, 1, 12)
        assert blame.cause == "rank 2 (node 1, host host1, pid 12) died first: exit status 13"
        assert blame.evidence["exit_status"] == 13 and blame.evidence["signal"] is None
        assert blame.evidence["revision"] == 101
        assert [d["rank"] for d in blame.evidence["deaths"]] == [2, 3, 0, 1]
        assert "after_s" not in json.dumps(blame.evidence)  # no host's time minus another's


def test_the_store_orders_deaths_even_where_the_clocks_say_the_opposite():
    # Node 0's rank really died first (the store recorded it first) but node 0's clock runs a
    # minute ahead of node 1's, where a rank died of it 40 ms later.
    blame = blame_crash(
        [death(1, 0, 1060.00, 13, 21, revision=7), death(2, 1, 1000.04, 1, 22, revision=8)]
    )
    assert blame is not None and (blame.culprit.rank, blame.culprit.node) == (1, 0)


def test_a_death_the_store_never_recorded_comes_after_every_recorded_one():
    # Node 0's store was away when its rank died (no revision): node 1's recorded death comes
    # first though its clock reads later; among unrecorded deaths, by node, then that node's
    # clock, never one node's clock against another's.
    deaths = [
        death(0, 0, 10.0, 13, 30),
        death(2, 1, 99.0, 1, 32, revision=5),
        death(1, 0, 9.0, -15, 31),
        death(3, 1, 2.0, -15, 33),
    ]
    blame = blame_crash(deaths)
    assert blame is not None and blame.culprit.rank == 2
    assert [d["rank"] for d in blame.evidence["deaths"]] == [2, 1, 0, 3]
    # One node alone (no store): its own clock orders its deaths, as it always did.
    alone = blame_crash([death(0, 0, 10.0, 13, 30), death(1, 0, 9.0, -15, 31)])
    assert alone is not None and alone.culprit.rank == 1


def test_a_killed_rank_is_named_by_its_signal_and_ties_go_to_the_lower_rank():
    blame = blame_crash([death(5, 1, 7.0, -9, 5), death(4, 1, 7.0, -9, 4)])
    assert blame is not None and blame.culprit.rank == 4
    assert blame.cause.endswith("died first: killed by SIGKILL")
    assert (blame.evidence["signal"], blame.evidence["exit_status"]) == ("SIGKILL", None)
    unknown = blame_crash([death(None, 0, 1.0, None, 77)])
    assert unknown is not None and unknown.culprit.rank is None
    assert (
        unknown.cause
        == "the worker with pid 77 on node 0 (host host0) died first: exit status unknown"
    )
    assert blame_crash([]) is None


def test_incident_keys_name_the_attempt_and_torchruns_worker_generation():
    from torchvitals.supervisor.localizer import generation_of, incident_key

    assert incident_key("hang", 2) == "hang-a0002"
    assert incident_key("crash", 2, 1) == "crash-a0002-r1"
    assert [generation_of(k) for k in ("hang-a0002", "crash-a0002-r1", "node_lost-a0002-n1")] == [
        0,
        1,
        0,
    ]
