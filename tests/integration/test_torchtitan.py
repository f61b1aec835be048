"""torchvitals in torchtitan 0.3.0's own Trainer (debug llama3 with its fused QKV, FSDP2,
default metrics), 2 gloo ranks on CPU under torchrun, with ``watch_torchtitan(trainer)`` as the
only line added to torchtitan's ``main()`` (the CPU harness: titan_harness.py).

    cd <repo> && python -m pytest tests/integration/test_torchtitan.py

Measured (seed 0, 20 steps): the report's loss equals torchtitan's logged global loss within
6e-8 relative (float32 vs the report's float64), the total grad norm equals torchtitan's clip
norm within 8.5e-8; a NaN on rank 1 at step 12 rolls both ranks back to step 10, the run ends
after 20 model steps with exit 0, and the LR stepped after the rollback is 0.5x the
scheduler's. With torchtitan's own checkpointer on, its checkpoints carry the back-off: a
restart from its step 12 (written after the rollback) with an empty checkpoint_dir steps at
0.5x its scheduler and repeats the uninterrupted run's losses exactly (float64 equal); with both
kinds of checkpoint the newer step is taken.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torchtitan  # noqa: F401  (a missing torchtitan fails here, never skips)

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
JOB = HERE / "titan_job.py"
LAYERS = [f"layers.{i}" for i in range(6)]


def torchrun(out: Path, *args: str, timeout: int = 600) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(JOB),
            "--out",
            str(out),
            *args,
        ],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    for r in range(2):
        (out / f"rank{r}.json").rename(out / f"rank{r}-done.json")
    return [json.loads((out / f"rank{r}-done.json").read_text()) for r in range(2)]


def test_a_nan_on_one_rank_rolls_both_back_and_the_run_trains_its_configured_steps(tmp_path):
    ranks = torchrun(
        tmp_path,
        "--steps",
        "20",
        "--fault-step",
        "12",
        "--fault-rank",
        "1",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    )
    actions = [[(r["step"], r["action"]) for r in rank["reports"]] for rank in ranks]
    assert actions[0] == actions[1], "the ranks took different decisions"

    # Healthy until the fault: per-layer blocks, no other verdict (no false warning), every
    # report identical on both ranks (as JSON: the rolled-back step's loss is NaN).
    def same(reports):
        return [
            json.dumps({k: v for k, v in r.items() if k != "id"}, sort_keys=True) for r in reports
        ]

    assert same(ranks[0]["reports"]) == same(ranks[1]["reports"])
    assert ranks[1]["injected"] == [12] and ranks[0]["injected"] == []
    for rank in ranks:
        reports = rank["reports"]
        rollbacks = [r for r in reports if r["action"] == "rollback"]
        assert [
            (r["step"], r["rollback"]["to_step"], r["rollback"]["lr_scale"]) for r in rollbacks
        ] == [(12, 10, 0.5)]
        assert rank["blocks"] == ["tok_embeddings", *LAYERS, "lm_head", "other"]
        assert rank["verdicts"] == ["[critical] step 12: nonfinite_loss"]
        assert rank["absorbed"] == [12]  # torchtitan's NaN check did not stop the run
        # torchtitan's step counter and its scheduler follow the rollback: 20 model steps
        assert rank["final_step"] == rank["agent_step"] == rank["sched_last_epoch"] == 20
        # steps 11 and 12 were trained again from the step-10 checkpoint, on new batches
        assert [r["step"] for r in reports if r["action"] == "step"] == [
            *range(1, 12),
            *range(11, 21),
        ]
        assert rank["finite_params"]
        assert all(math.isfinite(r["loss"]) for r in reports if r["action"] == "step")
        before = {r["step"]: r for r in reports[:11]}
        after = reports[12:]
        for r in reports[:11]:
            assert r["lr"] == [pytest.approx(x, rel=1e-9) for x in r["scheduled_lr"]]
        for r in after:  # torchtitan's scheduler, restored to step 10, backed off by half
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


FAULT = ("--fault-step", "12", "--fault-rank", "1")


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    """A 16-step run that ends after step 13 as a crash would, with both kinds of checkpoint:
    torchvitals' every 5 steps (``ckpt``: 5, 10) and torchtitan's own every 2 (``titan``); a
    NaN on rank 1 at step 12 rolls both ranks back to step 10 at learning-rate scale 0.5, then
    torchtitan saves step 10 again and step 12."""
    root = tmp_path_factory.mktemp("rolled-back")
    ranks = torchrun(
        root / "run",
        "--steps",
        "16",
        "--stop-after",
        "13",
        *FAULT,
        "--checkpoint-dir",
        str(root / "ckpt"),
        "--titan-folder",
        str(root / "titan"),
        "--titan-interval",
        "2",
    )
    return root, ranks


def _titan_copy(root: Path, dest: Path, upto: int = 10**9) -> str:
    """A copy of the run's torchtitan folder (a restart writes into its folder), with only the
    checkpoints of the steps up to ``upto``."""
    shutil.copytree(root / "titan", dest)
    for step in dest.glob("step-*"):
        if int(step.name.removeprefix("step-")) > upto:
            shutil.rmtree(step)
    return str(dest)


def _last_of_each_step(reports: list[dict]) -> dict[int, dict]:
    """The report of each step as it was finally trained (a rolled-back step repeats)."""
    return {r["step"]: r for r in reports if r["action"] == "step"}


def test_a_restart_resumes_from_the_torchvitals_checkpoint_with_the_back_off(rolled_back, tmp_path):
    root, _ = rolled_back
    ckpt = tmp_path / "ckpt"  # torchvitals' folder alone (torchtitan's checkpointer off)
    shutil.copytree(root / "ckpt", ckpt)
    ranks = torchrun(tmp_path / "again", "--steps", "16", "--checkpoint-dir", str(ckpt), "--resume")
    for rank in ranks:
        assert rank["resumed_from"] == 10
        reports = rank["reports"]
        assert [r["step"] for r in reports] == list(range(11, 17))
        assert rank["final_step"] == rank["sched_last_epoch"] == 16
        assert rank["verdicts"] == []
        # the back-off survived the restart: half the scheduler's LR, every step
        for r in reports:
            assert r["lr"] == [pytest.approx(0.5 * x, rel=1e-9) for x in r["scheduled_lr"]]
        assert rank["stepped_lr"][-6] == [pytest.approx(0.5 * reports[0]["scheduled_lr"][0])]


def test_torchtitans_own_checkpoints_carry_the_back_off_and_a_restart_from_them_keeps_it(
    rolled_back, tmp_path
):
    root, first = rolled_back
    assert sorted(int(p.name[5:]) for p in (root / "titan").glob("step-*")) == [2, 4, 6, 8, 10, 12]
    for rank in first:
        assert [(r["step"], r["action"]) for r in rank["reports"] if r["action"] != "step"] == [
            (12, "rollback")
        ]
        assert rank["final_step"] == rank["sched_last_epoch"] == 13
    # The reference: the same run, not stopped.
    through = torchrun(
        tmp_path / "through",
        "--steps",
        "16",
        *FAULT,
        "--checkpoint-dir",
        str(tmp_path / "ckpt-through"),
        "--titan-folder",
        str(tmp_path / "titan-through"),
        "--titan-interval",
        "2",
    )
    # A restart from torchtitan's folder alone: torchvitals' checkpoint_dir is a new, empty one.
    ranks = torchrun(
        tmp_path / "again",
        "--steps",
        "16",
        "--checkpoint-dir",
        str(tmp_path / "fresh"),
        "--titan-folder",
        _titan_copy(root, tmp_path / "titan"),
        "--titan-interval",
        "2",
    )
    for rank, ref in zip(ranks, through):
        assert rank["resumed_from"] == 12
        # what torchtitan's step-12 checkpoint, written after the rollback, carried: the
        # back-off, the skip list (empty: torchtitan draws its own batches, so a rollback
        # re-seeds instead of skipping), the rollback the loop guard still counts, 2 ticks back
        assert rank["adopted"] == {
            "step": 12,
            "lr_scale": 0.5,
            "skipped": [],
            "position": 0,
            "rollbacks_ago": [2],
        }
        assert rank["lr_scale"] == 0.5 and rank["skipped"] == [] and rank["recent_rollbacks"] == 1
        assert [
            (e["event"], e["step"], e["lr_scale"], e["skipped"])
            for e in rank["ledger"]
            if e["event"] == "adopt"
        ] == [("adopt", 12, 0.5, [])]
        reports = rank["reports"]
        assert [(r["step"], r["action"]) for r in reports] == [(s, "step") for s in range(13, 17)]
        assert rank["final_step"] == rank["agent_step"] == rank["sched_last_epoch"] == 16
        for r in reports:  # torchtitan's scheduler, restored to step 12, backed off by half
            assert r["lr"] == [pytest.approx(0.5 * x, rel=1e-9) for x in r["scheduled_lr"]]
        # what the AdamW really stepped with (after the one step at LR 0 by which torch's DCP
        # state-dict loader builds an empty optimizer's state before loading into it)
        assert rank["stepped_lr"][-len(reports) :] == [
            [pytest.approx(0.5 * r["scheduled_lr"][0], rel=1e-9)] for r in reports
        ]
        # the restart continues the run as it went on: weights, optimizer, schedule, data
        after = _last_of_each_step(ref["reports"])
        for r in reports:
            assert r["lr"] == [pytest.approx(x, rel=1e-12) for x in after[r["step"]]["lr"]]
            assert r["loss"] == pytest.approx(after[r["step"]]["loss"], rel=1e-5), r["step"]
    # torchtitan's load came after watch(): the goodput records book it as checkpoint time of
    # the step it delayed (the first), not as that step's work.
    (records,) = (tmp_path / "fresh" / "goodput").glob("steps-*.jsonl")
    steps = [r for r in map(json.loads, records.read_text().splitlines()) if r["e"] == "step"]
    assert steps[0]["s"] == 13 and 0 < steps[0]["c"] <= steps[0]["d"]


def test_with_both_kinds_of_checkpoint_a_restart_takes_the_newer(rolled_back, tmp_path):
    root, _ = rolled_back
    for upto, resumed in ((12, 12), (8, 10)):
        # torchtitan's step 12 is newer than torchvitals' step 10: torchtitan's is loaded, with
        # the same back-off as the ledger's (nothing new to adopt). Its step 8 is older:
        # torchtitan's load is left off, the run continues from torchvitals' step 10.
        ckpt = tmp_path / f"ckpt-{upto}"
        shutil.copytree(root / "ckpt", ckpt)
        ranks = torchrun(
            tmp_path / f"upto-{upto}",
            "--steps",
            "16",
            "--checkpoint-dir",
            str(ckpt),
            "--resume",
            "--titan-folder",
            _titan_copy(root, tmp_path / f"titan-{upto}", upto),
            "--titan-interval",
            "2",
        )
        for rank in ranks:
            assert rank["resumed_from"] == resumed and rank["lr_scale"] == 0.5
            assert rank["adopted"] == (
                {"step": 12, "lr_scale": 0.5, "skipped": [], "position": 0, "rollbacks_ago": [2]}
                if resumed == 12
                else None
            )
            assert not [e for e in rank["ledger"] if e["event"] == "adopt"]
            assert [r["step"] for r in rank["reports"]] == list(range(resumed + 1, 17))
            assert rank["final_step"] == rank["sched_last_epoch"] == 16
            for r in rank["reports"]:
                assert r["lr"] == [pytest.approx(0.5 * x, rel=1e-9) for x in r["scheduled_lr"]]


def test_the_example_trains_torchtitan_under_the_agent(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    env.update(
        OMP_NUM_THREADS="1",
        TORCHVITALS_METRICS_PORT="0",
        TORCHVITALS_LOG_DIR=str(tmp_path / "runs"),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(HERE / "titan_example_job.py"),
            str(tmp_path),
            "3",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    events = list((tmp_path / "runs").glob("*/events.jsonl"))
    assert events, "the agent wrote no event log"
    steps = [json.loads(line).get("step") for line in events[0].read_text().splitlines()]
    assert [s for s in steps if s is not None][-1] == 3
