"""A rollback on a 2 x 2 mesh of 4 gloo ranks (HSDP, FSDP x tensor parallel) ends where an
uninterrupted run that skips the same batches at the backed-off learning rate ends.

The scenario (and why each number is what it is) is ``mesh_ranks.rollback``.
"""

import pytest
from mesh_ranks import FAULT_STEP, MESH_WATCH, rollback
from support.meshes import LAYOUTS, WORLD
from support.world import run_world

M = MESH_WATCH["skip_margin"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", LAYOUTS)
def test_nan_on_one_rank_of_the_mesh_rolls_back_to_the_reference_model(kind, tmp_path):
    results = run_world(rollback, kind, str(tmp_path), world=WORLD, timeout=360)
    expected = {
        "to_step": 10,
        "lr_scale": 0.5,
        "skipped": [10, FAULT_STEP + M],
        "repeat_of": None,
        "escalation": 0,
    }
    for rank, r in enumerate(results):
        actions = [(x["step"], x["action"]) for x in r["reports"] if x["action"] != "step"]
        assert actions == [(FAULT_STEP, "rollback")], f"{kind} rank {rank}: {actions}"
        report = next(x for x in r["reports"] if x["action"] == "rollback")
        assert report["rollback"] == expected, f"{kind} rank {rank}: {report['rollback']}"
        assert r["ids"] == list(range(FAULT_STEP)) + list(range(FAULT_STEP + M, 20)), r["ids"]
        assert r["final_step"] == 10 + 20 - (FAULT_STEP + M), r["final_step"]
        assert r["lr_scale"] == 0.5 and r["skipped"] == [[10, FAULT_STEP + M]], r
        assert r["moved_since_10"], f"{kind} rank {rank}: no training after the rollback"
        assert r["mismatch"] == {}, (
            f"{kind} rank {rank}: final weights differ from the reference "
            f"(max abs diff per parameter): {r['mismatch']}"
        )
    first = [(x["step"], x["action"], x["rollback"]) for x in results[0]["reports"]]
    for rank, r in enumerate(results[1:], start=1):
        theirs = [(x["step"], x["action"], x["rollback"]) for x in r["reports"]]
        assert theirs == first, f"{kind}: rank {rank} disagrees with rank 0"
