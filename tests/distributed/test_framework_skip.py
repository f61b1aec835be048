"""A step the framework skipped by itself is that step's skip (issue 20, item 2): when the loop
or a framework skips ``optimizer.step()`` (DeepSpeed's overflow, a GradScaler's, a loop's own
test) and clears the gradients, the losses recorded for it are settled in that step on every
rank, and the next, healthy step is stepped with its own loss."""

from __future__ import annotations

import math

import pytest

from skip_ranks import FAULT, loop_that_skips_by_itself
from support.world import run_world


def test_a_step_the_loop_skipped_is_reported_as_its_own_skip_and_the_next_one_steps():
    steps = 8
    ranks = run_world(loop_that_skips_by_itself, steps, timeout=180)
    assert [(a["step"], a["action"]) for a in ranks[0]["reports"]] == \
        [(b["step"], b["action"]) for b in ranks[1]["reports"]], "the ranks decided differently"
    reports = ranks[0]["reports"]
    assert [r["step"] for r in reports] == list(range(1, steps + 1))
    assert [r["action"] for r in reports] == ["step"] * (FAULT - 1) + ["skip"] + \
        ["step"] * (steps - FAULT)
    assert reports[FAULT - 1]["nonfinite_loss"] and math.isnan(reports[FAULT - 1]["loss"])
    for i, report in enumerate(reports):
        if i != FAULT - 1:       # each step's own loss: the mean over the ranks, none carried
            mean = sum(rank["losses"][i] for rank in ranks) / len(ranks)
            assert report["loss"] == pytest.approx(mean, rel=1e-6), i
    for rank in ranks:
        assert rank["skipped_by_loop"] == [FAULT]
        assert rank["real"] == steps - 1 and rank["step_count"] == steps
