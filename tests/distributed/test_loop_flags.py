"""What one rank's loop does alone with a step reaches every rank in that step's reduction: a
step one rank's loop skipped is skipped by every rank (the replicas stay equal), and a second
step on the same gradients on one rank stops every rank with the same DoubleStepError."""

from __future__ import annotations

from loop_flags_ranks import FAULT, one_rank_skips, one_rank_steps_twice
from support.world import run_world


def test_a_step_one_ranks_loop_skipped_is_skipped_by_every_rank():
    steps = 7
    ranks = run_world(one_rank_skips, steps, timeout=180)
    assert ranks[0]["reports"] == ranks[1]["reports"], "the ranks decided differently"
    for step, action, count, named in ranks[0]["reports"]:
        if step == FAULT:
            assert (action, count, named) == ("skip", 1, [1]), (step, action, count, named)
        else:
            assert (action, count, named) == ("step", 0, []), (step, action, count, named)
    assert [r["real"] for r in ranks] == [steps - 1, steps - 1]
    assert ranks[0]["weights"] == ranks[1]["weights"], "the DDP replicas parted"


def test_a_second_step_on_one_rank_stops_every_rank_naming_it():
    ranks = run_world(one_rank_steps_twice, timeout=180)
    for rank in ranks:
        assert rank["step"] == FAULT and rank["unchanged"], rank
        assert "no backward pass since the last step on rank 1" in rank["error"], rank
    assert ranks[0]["error"] == ranks[1]["error"]
