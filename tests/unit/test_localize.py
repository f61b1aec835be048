"""Naming the culprit of a hang or a crash from every node's findings: the rules in order
(stopped, gone, spinning, silent, behind, none), the first death across nodes, the stacks as
faulthandler writes them, and the findings' round trip through the store's JSON.

python -m pytest tests/unit/test_localize.py
"""

from __future__ import annotations

import faulthandler
import itertools
import threading

import pytest

from torchvitals.collector.supervisor.findings import (
    STACK_EXCERPT_CHARS,
    NodeFindings,
    RankDeath,
    RankFinding,
)
from torchvitals.collector.supervisor.localize import crash_verdict, hang_verdict, union
from torchvitals.collector.supervisor.rank_probe import parse_stack

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
    assert "test_localize.py" in frame


def test_a_stopped_rank_is_the_culprit_before_anything_else():
    ranks = [
        rank(0),
        rank(1),
        rank(2, state="T", asked=False, stack="", waiting=None, frame=None),
        rank(3, stack_text=SPINNING),
    ]
    verdict = hang_verdict(ranks)
    assert verdict.rule == "stopped"
    assert (verdict.culprit.rank, verdict.culprit.node, verdict.culprit.pid) == (2, 1, 1002)
    assert verdict.cause == "rank 2 (node 1, host host1, pid 1002) is stopped (SIGSTOP)"
    assert verdict.evidence["state"] == "T"
    assert [r["state"] for r in verdict.evidence["ranks"]] == ["S", "S", "T", "S"]


def test_a_rank_spinning_in_user_code_while_the_others_wait_is_the_culprit_with_its_frame():
    verdict = hang_verdict([rank(0), rank(1, stack_text=SPINNING), rank(2), rank(3)])
    assert verdict.rule == "spinning" and verdict.culprit.rank == 1
    assert verdict.evidence["frame"] == 'File "/tmp/fh/r.py", line 10 in spin'
    assert 'runs File "/tmp/fh/r.py", line 10 in spin while ranks 0, 2, 3 wait in' in verdict.cause
    solo = hang_verdict([rank(0, stack_text=SPINNING), rank(1)])
    assert solo.cause.endswith("while rank 1 waits in one")
    assert verdict.evidence["waiting"] == [0, 2, 3]


def test_a_rank_that_does_not_answer_while_the_others_wait_is_named_silent():
    quiet = rank(3, state="D", stack="", waiting=None, frame=None)
    verdict = hang_verdict([rank(0), rank(1), rank(2), quiet])
    assert (verdict.rule, verdict.culprit.rank) == ("silent", 3)
    assert "state D" in verdict.cause


def test_a_gone_rank_is_named_while_the_others_still_run():
    gone = rank(1, state="gone", asked=False, stack="", waiting=None, frame=None)
    assert (hang_verdict([rank(0), gone]).rule, hang_verdict([rank(0), gone]).culprit.rank) == (
        "gone",
        1,
    )
    # Every process gone (a restart that hangs before its first heartbeat): nobody to name.
    everyone = [rank(r, state="gone", asked=False, stack="", waiting=None) for r in range(2)]
    verdict = hang_verdict(everyone)
    assert verdict.rule == "none" and verdict.culprit.rank is None


def test_without_stacks_the_rank_whose_heartbeat_stopped_long_before_is_behind():
    blind = {"stack": "", "waiting": None, "frame": None, "asked": False}
    ranks = [
        rank(0, step=41, beat_time=100.0, **blind),
        rank(1, step=37, beat_time=90.0, **blind),
        rank(2, step=41, beat_time=100.5, **blind),
    ]
    verdict = hang_verdict(ranks)
    assert (verdict.rule, verdict.culprit.rank) == ("behind", 1)
    assert "step 37, 10 s older than the others' (step 41)" in verdict.cause
    # A lower step written within the heartbeat interval of the others says nothing: the agents
    # write at most once a second, so a fast job's files lag by a step or more.
    close = [rank(0, step=41, **blind), rank(1, step=40, beat_time=99.5, **blind)]
    assert hang_verdict(close).rule == "none"


def test_when_every_rank_waits_alike_no_culprit_is_named():
    verdict = hang_verdict([rank(r) for r in range(4)])
    assert verdict.rule == "none" and verdict.culprit.rank is None and verdict.culprit.node is None
    assert verdict.cause == "no rank stands out: every rank waits in a collective (step 41)"
    assert len(verdict.evidence["ranks"]) == 4


def node_findings(node: int, key: str = "hang-a0002", **parts) -> NodeFindings:
    return NodeFindings(node=node, host=f"host{node}", key=key, **parts)


def test_every_node_names_the_same_culprit_whatever_order_the_findings_come_in():
    nodes = [
        node_findings(0, ranks=(rank(0), rank(1))),
        node_findings(1, ranks=(rank(2, stack_text=SPINNING), rank(3))),
    ]
    verdicts = set()
    for order in itertools.permutations(nodes):
        ranks, _ = union([NodeFindings.from_json(n.to_json()) for n in order])
        verdict = hang_verdict(ranks)
        verdicts.add((verdict.culprit, verdict.cause))
    assert verdicts == {
        (
            hang_verdict([rank(0), rank(1), rank(2, stack_text=SPINNING), rank(3)]).culprit,
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


def death(rank: int | None, node: int, at: float, status: int | None, pid: int = 0) -> RankDeath:
    return RankDeath(
        rank=rank, node=node, host=f"host{node}", pid=pid or 2000 + node, at=at, status=status
    )


def test_the_first_death_across_nodes_is_the_crash_culprit_with_its_status():
    # Rank 2 (node 1) exited 13; torchrun stopped rank 3 a few ms later; node 0's ranks died of
    # the broken collective after that.
    nodes = [
        node_findings(
            0, "crash-a0001", deaths=(death(0, 0, 50.30, 1, 10), death(1, 0, 50.31, 1, 11))
        ),
        node_findings(
            1, "crash-a0001", deaths=(death(3, 1, 50.21, -15, 13), death(2, 1, 50.20, 13, 12))
        ),
    ]
    for order in itertools.permutations(nodes):
        _, deaths = union([NodeFindings.from_json(n.to_json()) for n in order])
        verdict = crash_verdict(deaths)
        assert verdict is not None
        assert (verdict.culprit.rank, verdict.culprit.node, verdict.culprit.pid) == (2, 1, 12)
        assert verdict.cause == "rank 2 (node 1, host host1, pid 12) died first: exit status 13"
        assert verdict.evidence["exit_status"] == 13 and verdict.evidence["signal"] is None
        assert [d["rank"] for d in verdict.evidence["deaths"]] == [2, 3, 0, 1]


def test_a_killed_rank_is_named_by_its_signal_and_ties_go_to_the_lower_rank():
    verdict = crash_verdict([death(5, 1, 7.0, -9, 5), death(4, 1, 7.0, -9, 4)])
    assert verdict is not None and verdict.culprit.rank == 4
    assert verdict.cause.endswith("died first: killed by SIGKILL")
    assert (verdict.evidence["signal"], verdict.evidence["exit_status"]) == ("SIGKILL", None)
    unknown = crash_verdict([death(None, 0, 1.0, None, 77)])
    assert unknown is not None and unknown.culprit.rank is None
    assert (
        unknown.cause
        == "the worker with pid 77 on node 0 (host host0) died first: exit status unknown"
    )
    assert crash_verdict([]) is None


def test_incident_keys_name_the_attempt_and_torchruns_worker_generation():
    from torchvitals.collector.supervisor.localizer import generation_of, incident_key

    assert incident_key("hang", 2) == "hang-a0002"
    assert incident_key("crash", 2, 1) == "crash-a0002-r1"
    assert [generation_of(k) for k in ("hang-a0002", "crash-a0002-r1", "node_lost-a0002-n1")] == [
        0,
        1,
        0,
    ]
