"""Raw Accelerate (no Trainer) under torchrun with 2 gloo ranks, ``watch()`` given what
``accelerator.prepare`` returns: the norms are accelerate's own pre-clip ones, the loss is the
mean over ranks and micro-batches, a NaN on one rank rolls both back in the same step with the
LR halved, no step is taken twice, and the replicas end equal."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import accelerate  # noqa: F401  (a missing accelerate fails here, never skips)
import pytest
import torch

import torchvitals
from torchvitals.errors import TorchvitalsError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _torchrun(
    script: Path, out: Path, *args: str, timeout: int = 400
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHVITALS_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=env.get("PYTHONPATH", ""))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            *args,
        ],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_accelerate_prepared_objects_are_watched_exactly_and_roll_back_together(tmp_path):
    fault = 12
    done = _torchrun(
        HERE / "accelerate_job.py",
        tmp_path,
        str(tmp_path),
        "--fault-step",
        str(fault),
        "--steps",
        "30",
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    reports = ranks[0]["reports"]
    assert [(r["step"], r["action"]) for r in reports] == [
        (r["step"], r["action"]) for r in ranks[1]["reports"]
    ], "the ranks decided differently"
    assert len(reports) == ranks[0]["syncs"] == 30  # one step per synchronised step
    # The total norm is accelerate's clip_grad_norm_'s own (the pre-clip one), on both ranks.
    for rank in ranks:
        for report, norm in zip(rank["reports"], rank["clip_norms"]):
            if report["action"] == "step":
                assert report["grad_norm_total"] == pytest.approx(norm, rel=1e-6, abs=1e-9)
    assert any(r["grad_norm_total"] > 0.5 * 1.2 for r in reports), "no step was clipped"
    # The loss: the mean over both ranks and both micro-batches.
    k = ranks[0]["accumulate"]
    for i, report in enumerate(reports[:fault]):
        mean = sum(sum(rank["micro_losses"][k * i : k * i + k]) / k for rank in ranks) / 2
        assert report["loss"] == pytest.approx(mean, rel=1e-6), i
    # One rollback, at the faulty step, on both ranks, to the last checkpoint, LR halved.
    rollbacks = [r for r in reports if r["action"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["step"] == fault + 1, reports
    assert rollbacks[0]["rollback"]["to_step"] == 10 and rollbacks[0]["rollback"]["lr_scale"] == 0.5
    for rank in ranks:
        # Every real step of the inner optimizer is a reported step: none twice, none unseen.
        steps = [(i, r) for i, r in enumerate(rank["reports"]) if r["action"] == "step"]
        assert len(rank["real"]) == len(steps)
        for (i, report), real in zip(steps, rank["real"]):
            scale = 0.5 if i > fault else 1.0
            assert real["lr"] == pytest.approx(scale * rank["sched_lr"][i], rel=1e-9), i
            assert real["lr"] == pytest.approx(report["lr"][0], rel=1e-9), i
            assert real["grad_norm"] <= 0.5 * (1 + 1e-4)  # accelerate clipped
        assert rank["lr_scale"] == 0.5
    assert all(math.isfinite(r["loss"]) for r in reports if r["action"] == "step")
    assert ranks[0]["params"] == ranks[1]["params"], "the replicas diverged"


def test_the_accelerate_example_runs(tmp_path):
    done = _torchrun(ROOT / "examples" / "accelerate_loop.py", tmp_path, "--steps", "12")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert "step 12 step loss" in done.stdout


class _Holder:
    """A wrapper in accelerate's shape around a torch optimizer, and one around nothing."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_a_wrapper_is_unwrapped_and_anything_else_is_refused_by_name():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchvitals.watch(model, _Holder(_Holder(opt)), log_dir="", metrics_port=0) as agent:
        assert agent.optimizer is opt
        model(torch.randn(3, 4)).sum().backward()
        before = model.weight.detach().clone()
        opt.step()  # the inner optimizer is the guarded one
        assert agent.step_count == 1 and not torch.equal(before, model.weight)
    with pytest.raises(TorchvitalsError, match=r"needs a torch.optim.Optimizer.*_Holder"):
        torchvitals.watch(model, _Holder(object()), log_dir="", metrics_port=0)
    with pytest.raises(TorchvitalsError, match="scheduler must have step"):
        torchvitals.watch(model, opt, object(), log_dir="", metrics_port=0)
