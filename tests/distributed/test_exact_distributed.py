"""DDP and FSDP2, world size 2 on gloo: exact signals, identical reports, one packed reduction."""

import math

import pytest

from dist_scenarios import exact, nonfinite_on_one_rank
from tvsupport import run_world


@pytest.mark.parametrize("kind,config", [
    ("ddp", {}),
    ("ddp", {"split_ddp_work": False}),
    ("fsdp", {}),
])
def test_signals_match_single_process_reference(kind, config):
    rank0, rank1 = run_world(exact, kind, 5, config)
    assert rank0 == rank1, "reports differ between ranks"
    assert len(rank0) == 5 and all(r["action"] == "step" for r in rank0)
    assert all(len(r["rank_step_seconds"]) == 2 and min(r["rank_step_seconds"]) > 0 for r in rank0)


@pytest.mark.parametrize("kind,where,config", [
    ("ddp", "loss", {}),
    ("fsdp", "loss", {}),
    ("fsdp", "grad", {}),
    # A gradient corrupted on one rank after DDP's all-reduce is only seen by the rank that
    # measures that block: without the split every rank measures every block.
    ("ddp", "grad", {"split_ddp_work": False}),
])
def test_nan_on_one_rank_skips_the_step_on_every_rank(kind, where, config):
    results = run_world(nonfinite_on_one_rank, kind, where, config)
    for rank, steps in enumerate(results):
        flagged = [s["step"] for s in steps if s["nonfinite"]]
        assert flagged == [3], f"rank {rank} flagged {flagged}"
        for s in steps:
            if s["step"] == 3:
                assert s["action"] == "skip" and not s["changed"] and not s["optimizer_stepped"]
            else:
                assert s["action"] == "step" and s["changed"]
    if where == "loss":
        assert results[0][2]["loss"] == "nan"
    assert [s["action"] for s in results[0]] == [s["action"] for s in results[1]]
