"""Failure scenarios on two DDP ranks (gloo): the same verdict on both ranks in the same step.

python -m pytest tests/scenarios/test_scenarios_distributed.py -q
"""

from __future__ import annotations

import pytest
from scenarios_more_ranks import nan_grad_on_one_rank, slow_rank
from support.world import run_world

pytestmark = pytest.mark.distributed


# ---------------------------------------------------------------- non-finite gradient (DDP)


def test_nan_gradient_on_one_rank_is_named_on_both_ranks():
    results = run_world(nan_grad_on_one_rank, 10, 1, 5, "blocks.1.mlp.0.weight")
    for rank, result in enumerate(results):
        assert result["history"] == [("nonfinite_grad", "blocks.1", 5)], (rank, result["history"])
        for s in result["steps"]:
            if s["step"] == 5:
                assert s["verdicts"] == [("nonfinite_grad", "blocks.1", 5, None)]
                assert s["action"] == "skip" and not s["changed"] and not s["nonfinite_loss"]
                assert "blocks.1" not in s["finite_blocks"] and len(s["finite_blocks"]) == 6
            else:
                assert s["action"] == "step" and s["changed"] and s["verdicts"] == []
    assert results[0]["steps"] == results[1]["steps"]
    assert results[0]["checksum"] == results[1]["checksum"], "the replicas stayed identical"


# ---------------------------------------------------------------- straggler (DDP)


def test_slow_data_loading_on_one_rank_is_a_straggler():
    results = run_world(slow_rank, 20, 1, 11, 0.15)
    for rank, result in enumerate(results):
        # straggler_steps=5 consecutive slow steps from step 11: rank 1 judges itself a straggler
        # at step 15, and its flag names it in step 16's reduction, once.
        assert result["history"] == [("straggler", None, 16, 1)], (rank, result["history"])
        if rank == 1:
            assert all(s["compute"] >= 0.15 for s in result["steps"][10:]), "the sleep counts"
    assert [s["verdicts"] for s in results[0]["steps"]] == [
        s["verdicts"] for s in results[1]["steps"]
    ]
