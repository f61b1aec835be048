"""torchvitals in torchtitan 0.3.0's own Trainer with pipeline parallelism: the debug llama3 cut
into two stages (1F1B), one per rank, 2 gloo ranks on CPU, ``watch_torchtitan(trainer)`` the only
line added (the CPU harness: titan_harness.py).

Rank 0 holds the embedding and layers 0-2, rank 1 layers 3-5, the norm and the head; the loss
exists on rank 1 only. Measured (seed 0): both ranks report the same nine blocks, torchtitan's
own loss within 6e-8 and its pipeline-wide clip norm within 1.2e-7 (relative), no verdict on a
healthy run; a NaN loss on the last stage at step 7 rolls both stages back to step 5 in the same
step, the run trains its 12 model steps at half the scheduler's LR after the rollback, and a
restart resumes every stage from the torchvitals checkpoint with the back-off.
"""

from __future__ import annotations

import math

import pytest
import torchtitan  # noqa: F401  (a missing torchtitan fails here, never skips)
from test_torchtitan import LAYERS, torchrun

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

BLOCKS = ["tok_embeddings", *LAYERS, "lm_head", "other"]


def test_two_pipeline_stages_roll_back_together_and_resume_with_the_back_off(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ranks = torchrun(
        tmp_path / "first",
        "--pipeline",
        "2",
        "--steps",
        "12",
        "--fault-step",
        "7",
        "--fault-rank",
        "1",
        "--checkpoint-dir",
        ckpt,
    )
    assert ranks[0]["reports"] == [
        dict(r, id=a["id"]) for r, a in zip(ranks[1]["reports"], ranks[0]["reports"])
    ]
    assert ranks[1]["injected"] == [7] and ranks[0]["injected"] == []
    last = ranks[1]  # the stage that computes the loss: torchtitan logs it there only
    for rank in ranks:
        assert rank["blocks"] == BLOCKS and rank["kinds"][0] == "embedding"
        assert rank["verdicts"] == ["[critical] step 7: nonfinite_loss"]
        reports = rank["reports"]
        assert [(r["step"], r["action"]) for r in reports] == [(s, "step") for s in range(1, 7)] + [
            (7, "rollback")
        ] + [(s, "step") for s in range(6, 13)]
        assert reports[6]["rollback"]["to_step"] == 5 and reports[6]["rollback"]["lr_scale"] == 0.5
        assert rank["final_step"] == rank["agent_step"] == rank["sched_last_epoch"] == 12
        assert rank["finite_params"]
        # every step kept: torchtitan's own loss and its pipeline-wide clip norm, as its last
        # stage logs them (the first stage logs no loss, and logged the rolled-back step too:
        # its non-finite check sees no loss there)
        stepped = [r for r in reports if r["action"] == "step"]
        assert [s for s, _, _ in last["titan_log"]] == [r["step"] for r in stepped]
        for r, (_, loss, norm) in zip(stepped, last["titan_log"]):
            assert r["loss"] == pytest.approx(loss, rel=1e-6), r["step"]
            assert r["grad_norm_total"] == pytest.approx(norm, rel=1e-6), r["step"]
        for r in reports[:6]:
            assert r["lr"] == [pytest.approx(x, rel=1e-9) for x in r["scheduled_lr"]]
        for r in reports[7:]:  # the scheduler restored to step 5, backed off by half
            assert math.isfinite(r["loss"])
            assert r["lr"] == [pytest.approx(0.5 * x, rel=1e-9) for x in r["scheduled_lr"]]
    assert last["absorbed"] == [7]  # torchtitan's NaN check did not stop the run
    again = torchrun(
        tmp_path / "again", "--pipeline", "2", "--steps", "14", "--checkpoint-dir", ckpt, "--resume"
    )
    for rank in again:
        assert rank["resumed_from"] == 10
        assert [r["step"] for r in rank["reports"]] == [11, 12, 13, 14]
        assert rank["verdicts"] == [] and rank["final_step"] == 14
        for r in rank["reports"]:
            assert r["lr"] == [pytest.approx(0.5 * x, rel=1e-9) for x in r["scheduled_lr"]]
