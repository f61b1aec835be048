"""torchvitals in torchtitan 0.3.0's own Trainer (debug llama3 with its fused QKV, FSDP2,
default metrics), 2 gloo ranks on CPU under torchrun, with ``watch_torchtitan(trainer)`` as the
only line added to torchtitan's ``main()`` (the CPU harness: titan_harness.py).

    cd <repo> && python -m pytest tests/integration/test_torchtitan.py

Measured (seed 0, 20 steps): the report's loss equals torchtitan's logged global loss within
6e-8 relative (float32 vs the report's float64), the total grad norm equals torchtitan's clip
norm within 8.5e-8; a NaN on rank 1 at step 12 rolls both ranks back to step 10, the run ends
after 20 model steps with exit 0, and the LR stepped after the rollback is 0.5x the
scheduler's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchtitan  # noqa: E402,F401  (a missing torchtitan fails here, never skips)

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
JOB = HERE / "titan_job.py"
LAYERS = [f"layers.{i}" for i in range(6)]


def torchrun(out: Path, *args: str, timeout: int = 600) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(JOB), "--out", str(out), *args],
                          cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    for r in range(2):
        (out / f"rank{r}.json").rename(out / f"rank{r}-done.json")
    return [json.loads((out / f"rank{r}-done.json").read_text()) for r in range(2)]


def test_a_healthy_run_reports_torchtitans_own_loss_and_clip_norm_per_layer(tmp_path):
    ranks = torchrun(tmp_path, "--steps", "8")
    for rank in ranks:
        assert rank["blocks"] == ["tok_embeddings", *LAYERS, "lm_head", "other"]
        assert rank["verdicts"] == []
        assert rank["final_step"] == rank["agent_step"] == 8
        reports = rank["reports"]
        assert [r["step"] for r in reports] == list(range(1, 9))
        assert all(r["action"] == "step" for r in reports)
        for r in reports:
            titan_loss = rank["titan_loss"][str(r["step"])]
            titan_norm = rank["titan_norm"][str(r["step"])]
            assert r["loss"] == pytest.approx(titan_loss, rel=1e-6), r["step"]
            assert r["grad_norm_total"] == pytest.approx(titan_norm, rel=1e-6), r["step"]
            assert r["lr"] == [pytest.approx(x) for x in rank["stepped_lr"][r["step"] - 1]]
    assert ranks[0]["reports"] == [dict(r, id=a["id"]) for r, a in zip(ranks[1]["reports"],
                                                                       ranks[0]["reports"])]


def test_a_nan_on_one_rank_rolls_both_back_and_the_run_trains_its_configured_steps(tmp_path):
    ranks = torchrun(tmp_path, "--steps", "20", "--fault-step", "12", "--fault-rank", "1",
                     "--checkpoint-dir", str(tmp_path / "ckpt"))
    actions = [[(r["step"], r["action"]) for r in rank["reports"]] for rank in ranks]
    assert actions[0] == actions[1], "the ranks took different decisions"
    assert ranks[1]["injected"] == [12] and ranks[0]["injected"] == []
    for rank in ranks:
        reports = rank["reports"]
        rollbacks = [r for r in reports if r["action"] == "rollback"]
        assert [(r["step"], r["rollback"]["to_step"], r["rollback"]["lr_scale"])
                for r in rollbacks] == [(12, 10, 0.5)]
        assert rank["absorbed"] == [12]          # torchtitan's NaN check did not stop the run
        # torchtitan's step counter and its scheduler follow the rollback: 20 model steps
        assert rank["final_step"] == rank["agent_step"] == rank["sched_last_epoch"] == 20
        # steps 11 and 12 were trained again from the step-10 checkpoint, on new batches
        assert [r["step"] for r in reports if r["action"] == "step"] == [*range(1, 12), *range(11, 21)]
        assert rank["finite_params"]
        assert all(math.isfinite(r["loss"]) for r in reports if r["action"] == "step")
        before = {r["step"]: r for r in reports[:11]}
        after = reports[12:]
        for r in reports[:11]:
            assert r["lr"] == [pytest.approx(x, rel=1e-9) for x in r["scheduled_lr"]]
        for r in after:     # torchtitan's scheduler, restored to step 10, backed off by half
            assert r["lr"] == [pytest.approx(0.5 * x, rel=1e-9) for x in r["scheduled_lr"]]
            if r["step"] in before:
                assert r["lr"][0] == pytest.approx(0.5 * before[r["step"]]["lr"][0], rel=1e-9)
        # what the AdamW inside the container really stepped with, right after the rollback
        assert rank["stepped_lr"][11] == [pytest.approx(0.5 * before[11]["lr"][0], rel=1e-9)]
        # torchtitan logged every step it kept, in order, and not the rolled-back one
        stepped = [r for r in reports if r["action"] == "step"]
        assert [s for s, _, _ in rank["titan_log"]] == [r["step"] for r in stepped]
        for r, (_, loss, norm) in zip(stepped, rank["titan_log"]):
            assert r["loss"] == pytest.approx(loss, rel=1e-6), r["step"]
            assert r["grad_norm_total"] == pytest.approx(norm, rel=1e-6), r["step"]


def test_a_restart_resumes_from_the_torchvitals_checkpoint_with_the_back_off(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    torchrun(tmp_path / "first", "--steps", "14", "--fault-step", "12", "--fault-rank", "1",
             "--checkpoint-dir", ckpt)
    ranks = torchrun(tmp_path / "again", "--steps", "16", "--checkpoint-dir", ckpt, "--resume")
    for rank in ranks:
        assert rank["resumed_from"] == 10
        reports = rank["reports"]
        assert [r["step"] for r in reports] == list(range(11, 17))
        assert rank["final_step"] == rank["sched_last_epoch"] == 16
        # the back-off survived the restart: half the scheduler's LR, every step
        for r in reports:
            assert r["lr"] == [pytest.approx(0.5 * x, rel=1e-9) for x in r["scheduled_lr"]]
        assert rank["stepped_lr"][-6] == [pytest.approx(0.5 * reports[0]["scheduled_lr"][0])]


def test_the_example_trains_torchtitan_under_the_agent(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    env.update(OMP_NUM_THREADS="1", TORCHVITALS_METRICS_PORT="0", TORCHVITALS_LOG_DIR=str(tmp_path / "runs"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(HERE / "titan_example_job.py"),
                           str(tmp_path), "3"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    events = list((tmp_path / "runs").glob("*/events.jsonl"))
    assert events, "the agent wrote no event log"
    steps = [json.loads(line).get("step") for line in events[0].read_text().splitlines()]
    assert [s for s in steps if s is not None][-1] == 3
