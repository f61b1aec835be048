"""DeepSpeed on CPU (``DS_ACCELERATOR=cpu``, gloo, 2 ranks under torchrun), watched as
``deepspeed.initialize`` returns it: ``watch(engine, engine.optimizer)``. Under ZeRO-1/2 the
gradients live in DeepSpeed's partitions (``param.grad`` is None): the per-block norms read from
them are exact against an fp64 reference, the total equals the engine's own
``get_global_grad_norm()`` (before its clipping), a NaN on one rank is skipped by both ranks in
that step, and the next step is a healthy one. With ZeRO off (stage 0) the engine clips with
its own ``clip_grad_norm_``: the norms are still the ones before it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import deepspeed  # noqa: E402,F401  (a missing DeepSpeed fails here, never skips)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _torchrun(script: Path, out: Path, *args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=env.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script), *args],
                          cwd=out, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_gradients_are_read_from_the_partitions_exactly_and_a_nan_is_that_steps_skip(
        tmp_path, stage):
    fault, steps = 5, 10
    done = _torchrun(HERE / "deepspeed_job.py", tmp_path, str(tmp_path), "--stage", str(stage),
                     "--fault-step", str(fault), "--steps", str(steps))
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["step"], r["action"]) for r in ranks[0]["reports"]] == \
        [(r["step"], r["action"]) for r in ranks[1]["reports"]], "the ranks decided differently"
    reports = ranks[0]["reports"]
    assert [r["action"] for r in reports] == ["step"] * (fault - 1) + ["skip"] + \
        ["step"] * (steps - fault)
    assert "nonfinite_loss" in reports[fault - 1]["verdicts"]
    assert not [r["verdicts"] for r in reports if any(v.startswith("dead_") for v in r["verdicts"])]
    clip = ranks[0]["clip"]
    for report in reports:
        if report["action"] != "step":
            continue
        for block, norm in report["grad_norm"].items():
            assert norm > 0 and norm == pytest.approx(report["ref"][block], rel=2e-6), block
        reference = math.sqrt(sum(v * v for v in report["ref"].values()))
        assert report["grad_norm_total"] == pytest.approx(reference, rel=2e-6)
        if stage:       # ZeRO's own norm (ZeRO off, the engine keeps none)
            assert report["grad_norm_total"] == pytest.approx(report["engine_norm"], rel=1e-6)
        assert math.isfinite(report["loss"])
    assert any(r["grad_norm_total"] > clip * 1.1 for r in reports), "the norms are not pre-clip"
    for rank in ranks:      # DeepSpeed clipped: each real step's gradient was at most clip
        assert all(n <= clip * (1 + 1e-5) for n in rank["real"])
        # One real step per healthy step (ZeRO steps its torch optimizer once per param group)
        assert len(rank["real"]) == (steps - 1) * (2 if stage else 1)
    assert ranks[0]["params"] == ranks[1]["params"]


def test_the_deepspeed_example_runs(tmp_path):
    done = _torchrun(ROOT / "examples" / "deepspeed_train.py", tmp_path, "--stage", "2",
                     "--steps", "6")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("step 6 step")]
    assert line, done.stdout[-3000:]
    ours, theirs = float(line[0].split("grad_norm ")[1].split()[0]), float(line[0].split()[-1])
    assert ours == pytest.approx(theirs, abs=2e-4)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_trainer_with_a_deepspeed_config_is_watched_by_the_callback_unchanged(tmp_path, stage):
    fault, steps = 5, 10
    done = _torchrun(HERE / "hf_deepspeed_job.py", tmp_path, str(tmp_path), "--stage", str(stage),
                     "--fault-step", str(fault), "--steps", str(steps), timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["step"], r["action"]) for r in ranks[0]["reports"]] == \
        [(r["step"], r["action"]) for r in ranks[1]["reports"]], "the ranks decided differently"
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


def test_zero_off_rolls_both_ranks_back_and_zero_checkpoints_are_refused_at_watch(tmp_path):
    (tmp_path / "s0").mkdir()
    done = _torchrun(HERE / "deepspeed_job.py", tmp_path / "s0", str(tmp_path / "s0"), "--stage",
                     "0", "--fault-step", "7", "--steps", "10", "--checkpoint-every", "3")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = [json.loads((tmp_path / "s0" / f"rank{r}.json").read_text()) for r in range(2)]
    reports = ranks[0]["reports"]
    assert [(r["step"], r["action"]) for r in reports] == \
        [(r["step"], r["action"]) for r in ranks[1]["reports"]]
    rollbacks = [r for r in reports if r["action"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["step"] == 7
    assert rollbacks[0]["rollback"]["to_step"] == 6 and rollbacks[0]["rollback"]["lr_scale"] == 0.5
    after = reports[reports.index(rollbacks[0]) + 1:]
    assert after and all(r["action"] == "step" and r["lr"][0] == pytest.approx(1.5e-3)
                         for r in after)
    assert ranks[0]["params"] == ranks[1]["params"]
    (tmp_path / "s2").mkdir()
    refused = _torchrun(HERE / "deepspeed_job.py", tmp_path / "s2", str(tmp_path / "s2"),
                        "--stage", "2", "--steps", "2", "--checkpoint-every", "1")
    assert refused.returncode != 0
    assert "cannot checkpoint or roll back DeepSpeed ZeRO-1/2" in refused.stdout + refused.stderr
