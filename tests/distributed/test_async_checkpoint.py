"""Background checkpoints and the step at more ranks, real gloo ranks:

- a write that fails on one rank (disk full) is reported on every rank in the same step, the
  previous checkpoint stays the rollback target, and the rollback restores it from memory;
- world size 8: exact signals against a single-process reference with one collective per
  unsampled step, and the same decisions (straggler, rollback, commits) on every rank.

SIGKILL during a background write is test_recovery.py's kill test (the writes it kills run in
the checkpoint thread now; it checks that too).
"""

from __future__ import annotations

import json

import pytest
from async_ranks import decisions_at_scale, write_fails_on_rank1
from dist_scenarios import exact
from support.world import run_world


def same(a, b) -> bool:
    """Equal, NaN losses included (NaN != NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.slow
def test_a_write_failure_on_one_rank_is_seen_by_every_rank_in_the_same_step(tmp_path):
    results = run_world(write_fails_on_rank1, str(tmp_path), timeout=180)
    assert same(results[0]["reports"], results[1]["reports"]), "the ranks disagree"
    reports = results[0]["reports"]
    failed = [(r["step"], r["failed"]) for r in reports if r["failed"]]
    assert len(failed) == 1, failed
    _, why = failed[0]
    assert "rank 1" in why and "File too large" in why and "rank 0" not in why, why
    bad = int(why.split(":")[0].removeprefix("step "))
    committed = [r["committed"] for r in reports if r["committed"]]
    assert bad not in committed and any(s > bad for s in committed), (bad, committed)
    assert f"step-{bad:08d}" not in results[0]["folders"], results[0]["folders"]
    assert not any(f.startswith(".tmp-") for f in results[0]["folders"]), results[0]["folders"]
    rollbacks = [r for r in reports if r["action"] == "rollback"]
    assert [r["step"] for r in rollbacks] == [45], [(r["step"], r["action"]) for r in reports]
    to_step = rollbacks[0]["rollback"]["to_step"]
    assert to_step != bad and to_step in committed, (to_step, bad, committed)
    for rank, r in enumerate(results):
        assert r["failures"] == 1, f"rank {rank}: {r['failures']} failed saves counted"
        assert r["disk_loads"] == 0, f"rank {rank}: the rollback read the disk"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eight_ranks_match_the_single_process_reference():
    results = run_world(exact, "ddp", 4, {}, world=8, timeout=240)
    assert all(r == results[0] for r in results), "reports differ between ranks"
    assert all(x["mean_step_seconds"] > 0 for x in results[0])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eight_ranks_take_every_decision_in_the_same_step(tmp_path):
    results = run_world(decisions_at_scale, str(tmp_path), world=8, timeout=240)
    reports = results[0]["reports"]
    for rank, r in enumerate(results):
        assert same(r["reports"], reports), f"rank {rank} disagrees with rank 0"
        assert r["disk_loads"] == 0, f"rank {rank}: the rollback read the disk"
        assert r["checksum"] == results[0]["checksum"], f"rank {rank}: the replicas differ"
    rollbacks = [
        (x["step"], x["rollback"]["to_step"]) for x in reports if x["action"] == "rollback"
    ]
    assert rollbacks == [(10, 8)], rollbacks
    assert [x["step"] for x in reports if x["checkpointed"]][:2] == [4, 8]
    named = [(i, x["step"], x["stragglers"]) for i, x in enumerate(reports) if x["stragglers"]]
    # Slow at steps 9, 10, then 9, 10, 11 after the rollback: it judges itself slow for the 5th
    # time at the second step 11, and its flag names it at the second step 12 (report 14).
    assert named and named[0] == (13, 12, [6]), named
