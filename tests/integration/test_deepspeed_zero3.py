"""DeepSpeed ZeRO-3 on CPU (``DS_ACCELERATOR=cpu``, gloo, 2 ranks under torchrun), watched as
``deepspeed.initialize`` returns it: ``watch(engine, engine.optimizer)``, and through the HF
Trainer with a stage-3 ``deepspeed=`` config and ``TransformersCallback``. Parameters, gradients
and optimizer state are all partitioned (``param.grad`` is None, ``param.data`` empty outside
forward): the per-block norms read from this rank's partitions are exact against an fp64
reference of every rank's micro-batches, the total equals the engine's own
``get_global_grad_norm()`` (before its clipping), the update ratio read from the parameter
partitions equals the one of the whole parameters, a NaN on one rank is that step's skip on
both ranks and the next step is a healthy one. Checkpoints are refused at watch()."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import deepspeed  # noqa: F401  (a missing DeepSpeed fails here, never skips)

HERE = Path(__file__).resolve().parent


def _torchrun(script: Path, out: Path, *args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=env.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script), *args],
                          cwd=out, env=env, capture_output=True, text=True, timeout=timeout)


def _ranks(out: Path) -> list[dict]:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["step"], r["action"]) for r in ranks[0]["reports"]] == \
        [(r["step"], r["action"]) for r in ranks[1]["reports"]], "the ranks decided differently"
    return ranks


def test_zero3_gradients_and_updates_are_read_from_the_partitions_exactly(tmp_path):
    fault, steps = 5, 10
    done = _torchrun(HERE / "deepspeed_zero3_job.py", tmp_path, str(tmp_path),
                     "--fault-step", str(fault), "--steps", str(steps))
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = _ranks(tmp_path)
    reports = ranks[0]["reports"]
    assert [r["action"] for r in reports] == ["step"] * (fault - 1) + ["skip"] + \
        ["step"] * (steps - fault)
    assert "nonfinite_loss" in reports[fault - 1]["verdicts"]
    assert not [r["verdicts"] for r in reports
                if any(v.startswith("dead_") or v == "vanishing_gradients" for v in r["verdicts"])]
    for report in reports:
        if report["action"] != "step":
            continue
        for block, norm in report["grad_norm"].items():
            assert norm > 0 and norm == pytest.approx(report["ref"][block], rel=2e-6), block
        reference = math.sqrt(sum(v * v for v in report["ref"].values()))
        assert report["grad_norm_total"] == pytest.approx(reference, rel=2e-6)
        assert report["grad_norm_total"] == pytest.approx(report["engine_norm"], rel=1e-6)
        assert math.isfinite(report["loss"])
    clip = ranks[0]["clip"]
    assert any(r["grad_norm_total"] > clip * 1.1 for r in reports), "the norms are not pre-clip"
    # Sampled every step: step s carries the ratio of the update applied at step s - 1, which
    # the job measured on the whole (gathered) parameters; the skipped step applied none.
    measured = [r for r in reports if r["update_ratio"]]
    assert len(measured) == steps - 2      # not step 1 (no update before it), nor step 6
    assert fault + 1 not in [r["step"] for r in measured]     # (the skip applied none)
    for report in measured:
        applied = reports[report["update_ratio_step"] - 1]
        assert applied["action"] == "step"
        for block, ratio in report["update_ratio"].items():
            assert ratio > 1e-4 and ratio == pytest.approx(applied["ref_update_ratio"][block],
                                                           rel=1e-5), block
    for rank in ranks:      # one step of each of the torch optimizer's two sub-groups per step
        assert len(rank["real"]) == (steps - 1) * 2


def test_zero3_with_the_optimizer_offloaded_reports_the_norms_missing_said_once(tmp_path):
    # Offloaded, the gradient partitions live in DeepSpeed's CPU buffers, which torchvitals does
    # not read: every block is missing (NaN, never 0), said once, and nothing is judged from it;
    # the loss and the update ratio are still measured (a NaN loss is still that step's skip).
    fault, steps = 5, 8
    done = _torchrun(HERE / "deepspeed_zero3_job.py", tmp_path, str(tmp_path), "--offload",
                     "--fault-step", str(fault), "--steps", str(steps))
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    reports = _ranks(tmp_path)[0]["reports"]
    assert [r["action"] for r in reports] == ["step"] * (fault - 1) + ["skip"] + \
        ["step"] * (steps - fault)
    assert [r["verdicts"] for r in reports] == [[]] * (fault - 1) + [["nonfinite_loss"]] + \
        [[]] * (steps - fault)
    for report in reports:
        assert report["missing"] == ["inp", "hid", "out"]
        assert all(math.isnan(v) for v in report["grad_norm"].values())
        assert math.isnan(report["grad_norm_total"]) and report["engine_norm"] > 0
    measured = [r for r in reports if r["update_ratio"]]
    assert measured and all(
        r["update_ratio"][b] == pytest.approx(reports[r["update_ratio_step"] - 1]
                                              ["ref_update_ratio"][b], rel=1e-5)
        for r in measured for b in r["update_ratio"])
    said = (done.stdout + done.stderr).count(
        "no rank could read a gradient of block(s) inp, hid, out")
    assert said == 1, said


def test_zero3_checkpoints_are_refused_at_watch_with_the_reason(tmp_path):
    refused = _torchrun(HERE / "deepspeed_zero3_job.py", tmp_path, str(tmp_path), "--steps", "2",
                        "--checkpoint-every", "1")
    assert refused.returncode != 0
    assert "cannot checkpoint or roll back DeepSpeed ZeRO-3" in refused.stdout + refused.stderr


def test_the_trainer_with_a_zero3_config_is_watched_by_the_callback_unchanged(tmp_path):
    fault, steps = 5, 10
    done = _torchrun(HERE / "hf_deepspeed_job.py", tmp_path, str(tmp_path), "--stage", "3",
                     "--fault-step", str(fault), "--steps", str(steps), timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = _ranks(tmp_path)
    reports = ranks[0]["reports"]
    # The NaN is injected at global_step == fault, i.e. in the Trainer's step fault + 1.
    assert [r["action"] for r in reports] == ["step"] * fault + ["skip"] + \
        ["step"] * (steps - fault - 1)
    assert ranks[0]["global_step"] == steps
    assert not [r["verdicts"] for r in reports if any(v.startswith("dead_") for v in r["verdicts"])]
    for report, engine in zip(reports, ranks[0]["engine_norms"]):
        if report["action"] == "step":
            assert report["grad_norm_total"] == pytest.approx(engine, rel=1e-6)
            assert all(v > 0 for v in report["grad_norm"].values())
            assert math.isfinite(report["loss"])
    assert any(r["grad_norm_total"] > ranks[0]["clip"] for r in reports), "not the pre-clip norm"
