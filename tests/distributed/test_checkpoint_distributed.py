"""Checkpoints under DDP and FSDP2, world size 2 on gloo: exact round trips, one rank failing."""

import pytest
from checkpoint_ranks import fail_on_rank1, save_train_load
from support.world import run_world


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_save_train_load_restores_every_rank_exactly(kind, tmp_path):
    results = run_world(save_train_load, kind, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["changed_by_training"], f"rank {rank}: the steps after the save changed nothing"
        assert r["state_restored"], (
            f"rank {rank}: model/optimizer/scheduler differ from the saved state"
        )
        assert r["rng_restored"], f"rank {rank}: its own RNG state was not restored"
        assert r["replay_equal"], (
            f"rank {rank}: replaying after the load diverged from the first run"
        )
        assert r["step"] == 2 and r["restored_path"] == r["path"] == str(tmp_path / "step-00000002")
        assert r["extra"] == {"position": 2, "rank_that_saved": 0}  # rank 0's extra is kept
        assert r["seconds"] > 0
    files = sorted(p.name for p in (tmp_path / "step-00000002").iterdir())
    assert files == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.json",
        "plain-rank-00000.json",
        "plain-rank-00001.json",
        "rng-rank-00000.json",
        "rng-rank-00001.json",
        "state.json",
    ]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_write_failure_on_rank1_raises_on_both_ranks(kind, tmp_path):
    results = run_world(fail_on_rank1, kind, str(tmp_path), timeout=120)
    phases = ["while writing the RNG states", "while writing the model and optimizer shards"]
    for rank, r in enumerate(results):
        for error, phase in zip(r["errors"], phases):
            assert error is not None, f"rank {rank}: the save succeeded"
            assert phase in error and "step-00000001) is untouched" in error, error
        # Each names the failing rank alone (DCP raises on every rank, naming the one that failed).
        assert (
            "rank 1: OSError: [Errno 27] File too large" in r["errors"][0]
            and "rank 0:" not in r["errors"][0]
        )
        assert "DCP on rank 1:" in r["errors"][1] and "DCP on rank 0" not in r["errors"][1]
        plain_write, plain_read = r["errors"][2:]
        assert plain_write is not None and "the non-tensor state: rank 1: OSError" in plain_write
        assert "No space left on device" in plain_write and "rank 0:" not in plain_write
        assert "step-00000001) is untouched" in plain_write, plain_write
        assert plain_read is not None and "no checkpoint under" in plain_read, plain_read
        assert "rank 1: ValueError: not JSON" in plain_read and "rank 0:" not in plain_read
        assert r["leftovers"] == ["step-00000001"], f"rank {rank}: {r['leftovers']}"
        assert r["step"] == 1 and r["state_restored"], f"rank {rank}: step 1 did not load intact"
