"""DDP and FSDP2, world size 2 on gloo: exact signals, identical reports, one packed reduction."""

import math

import pytest
from dist_scenarios import exact, nonfinite_on_one_rank, serve_metrics
from support.world import run_world


@pytest.mark.parametrize(
    "kind,config",
    [
        ("ddp", {}),
        ("ddp", {"split_ddp_work": False}),
        ("fsdp", {}),
    ],
)
def test_signals_match_single_process_reference(kind, config):
    rank0, rank1 = run_world(exact, kind, 5, config)
    assert rank0 == rank1, "reports differ between ranks"
    assert len(rank0) == 5 and all(r["action"] == "step" for r in rank0)
    assert all(r["mean_step_seconds"] > 0 for r in rank0)


@pytest.mark.parametrize(
    "kind,where,config",
    [
        ("ddp", "loss", {}),
        ("fsdp", "loss", {}),
        ("fsdp", "grad", {}),
        # A gradient corrupted on one rank after DDP's all-reduce is only seen by the rank that
        # measures that block: without the split every rank measures every block.
        ("ddp", "grad", {"split_ddp_work": False}),
    ],
)
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


def test_each_rank_serves_its_scalars_and_rank0_the_blocks():
    import socket

    from support.world import free_port

    while True:
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
                break
            except OSError:
                continue
    rank0, rank1 = run_world(serve_metrics, base)
    assert rank0["url"] == f"http://127.0.0.1:{base}/metrics"
    assert rank1["url"] == f"http://127.0.0.1:{base + 1}/metrics"
    assert rank0["ranks"] == ["0"] and rank1["ranks"] == ["1"]
    assert "torchvitals_grad_norm" in rank0["names"] and "torchvitals_loss" in rank0["names"]
    assert not any(
        n.startswith(("torchvitals_grad_norm", "torchvitals_activation", "torchvitals_update"))
        for n in rank1["names"]
    )
    assert "torchvitals_step_duration_seconds_count" in rank1["names"]
    for _rank, r in enumerate((rank0, rank1)):
        assert r["local_loss"] == r["report_local_loss"]
        # Each rank's compute-time histogram sums its own steps' compute times.
        assert r["compute"] == pytest.approx(r["report_compute"], rel=1e-12) and r["compute"] > 0
    assert rank0["local_loss"] != rank1["local_loss"]
    assert math.isclose(
        rank0["loss"], (rank0["local_loss"] + rank1["local_loss"]) / 2, rel_tol=1e-12
    )
