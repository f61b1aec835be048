"""DeepSpeed ZeRO-3 on CPU (``DS_ACCELERATOR=cpu``, gloo, 2 ranks under torchrun), watched as
``deepspeed.initialize`` returns it, with its optimizer offloaded to the CPU. Its exact norms
and update ratios, its NaN skip, its checkpoints and rollbacks and the Trainer with a stage-3
``deepspeed=`` config are in test_deepspeed.py, with the other stages."""

from __future__ import annotations

import math
from pathlib import Path

import deepspeed  # noqa: F401  (a missing DeepSpeed fails here, never skips)
import pytest
from real_steps import read_ranks as _ranks
from real_steps import torchrun as _torchrun

HERE = Path(__file__).resolve().parent
JOB = HERE / "deepspeed_job.py"


def test_zero3_with_the_optimizer_offloaded_reports_the_norms_missing_said_once(tmp_path):
    # Offloaded, the gradient partitions live in DeepSpeed's CPU buffers, which torchvitals does
    # not read: every block is missing (NaN, never 0), said once, and nothing is judged from it;
    # the loss and the update ratio are still measured (a NaN loss is still that step's skip).
    fault, steps = 5, 8
    done = _torchrun(
        JOB,
        tmp_path,
        str(tmp_path),
        "--stage",
        "3",
        "--offload",
        "--fault-step",
        str(fault),
        "--steps",
        str(steps),
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    reports = _ranks(tmp_path)[0]["reports"]
    assert [r["action"] for r in reports] == ["step"] * (fault - 1) + ["skip"] + ["step"] * (
        steps - fault
    )
    assert [r["verdicts"] for r in reports] == [[]] * (fault - 1) + [["nonfinite_loss"]] + [[]] * (
        steps - fault
    )
    for report in reports:
        assert report["missing"] == ["inp", "hid", "out"]
        assert all(math.isnan(v) for v in report["grad_norm"].values())
        assert math.isnan(report["grad_norm_total"]) and report["engine_norm"] > 0
    measured = [r for r in reports if r["update_ratio"]]
    assert measured and all(
        r["update_ratio"][b]
        == pytest.approx(reports[r["update_ratio_step"] - 1]["ref_update_ratio"][b], rel=1e-5)
        for r in measured
        for b in r["update_ratio"]
    )
    said = (done.stdout + done.stderr).count(
        "no rank could read a gradient of block(s) inp, hid, out"
    )
    assert said == 1, said


def test_zero3_checkpoints_with_the_optimizer_offloaded_are_refused_at_watch(tmp_path):
    # ZeRO-3 checkpoints and rolls back (test_deepspeed.py); offloaded, its partitions live in
    # DeepSpeed's offload buffers, which the in-place restore does not cover: refused, with why.
    refused = _torchrun(
        JOB,
        tmp_path,
        str(tmp_path),
        "--stage",
        "3",
        "--offload",
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
    )
    assert refused.returncode != 0
    out = refused.stdout + refused.stderr
    assert "cannot checkpoint or roll back this DeepSpeed ZeRO-3 engine" in out
    assert "offloaded" in out
