"""A step the framework skipped by itself is that step's skip: when the loop
or a framework skips ``optimizer.step()`` (DeepSpeed's overflow, a GradScaler's, a loop's own
test) and clears the gradients, the losses recorded for it are settled in that step on every
rank, and the next, healthy step is stepped with its own loss."""

from __future__ import annotations

import math

import pytest
from skip_ranks import FAULT, loop_that_skips_by_itself, loop_with_a_scaler
from support.world import run_world


def test_a_step_the_loop_skipped_is_reported_as_its_own_skip_and_the_next_one_steps():
    steps = 8
    ranks = run_world(loop_that_skips_by_itself, steps, timeout=180)
    assert [(a["step"], a["action"]) for a in ranks[0]["reports"]] == [
        (b["step"], b["action"]) for b in ranks[1]["reports"]
    ], "the ranks decided differently"
    reports = ranks[0]["reports"]
    assert [r["step"] for r in reports] == list(range(1, steps + 1))
    assert [r["action"] for r in reports] == ["step"] * (FAULT - 1) + ["skip"] + ["step"] * (
        steps - FAULT
    )
    assert reports[FAULT - 1]["nonfinite_loss"] and math.isnan(reports[FAULT - 1]["loss"])
    for i, report in enumerate(reports):
        if i != FAULT - 1:  # each step's own loss: the mean over the ranks, none carried
            mean = sum(rank["losses"][i] for rank in ranks) / len(ranks)
            assert report["loss"] == pytest.approx(mean, rel=1e-6), i
    for rank in ranks:
        assert rank["skipped_by_loop"] == [FAULT]
        assert rank["real"] == steps - 1 and rank["step_count"] == steps


@pytest.mark.parametrize(
    "clears, routed",
    [
        ([["model"], ["model"]], False),
        ([["optimizer", "model"], ["inner"]], False),  # each rank its own door, rank 0 two
        ([["model"], ["model"]], True),
    ],
    ids=["model.zero_grad", "different-doors", "scaler-routed"],
)
def test_a_gradscaler_skip_is_that_steps_skip_on_both_ranks_whichever_zero_grad(clears, routed):
    """A CPU GradScaler skips the step on both ranks (rank 1's loss is Inf at FAULT) and the loop
    clears the gradients with ``model.zero_grad()`` (DDP's, or the module's inside it) or the
    optimizer's: the skip is settled in that step, once, on both ranks; the next step reports its
    own loss and the real step's gradient norm; no healthy step is lost."""
    steps = 7
    ranks = run_world(loop_with_a_scaler, steps, clears, routed, timeout=180)
    assert [(a["step"], a["action"]) for a in ranks[0]["reports"]] == [
        (b["step"], b["action"]) for b in ranks[1]["reports"]
    ], "the ranks decided differently"
    reports = ranks[0]["reports"]
    assert [(r["step"], r["action"]) for r in reports] == [
        (s, "skip" if s == FAULT else "step") for s in range(1, steps + 1)
    ]
    assert reports[FAULT - 1]["nonfinite_loss"] and not math.isfinite(reports[FAULT - 1]["loss"])
    stepped = [r for r in reports if r["action"] == "step"]
    for rank in ranks:
        assert len(rank["real"]) == steps - 1 and rank["step_count"] == steps
        assert not rank["patched_after_close"]
        for report, real_norm in zip(stepped, rank["real"]):
            assert report["grad_norm_total"] == pytest.approx(real_norm, rel=1e-5), report
    for report in stepped:
        mean = sum(rank["losses"][report["step"] - 1] for rank in ranks) / len(ranks)
        assert report["loss"] == pytest.approx(mean, rel=1e-6), report
