"""DeepSpeed on CPU (``DS_ACCELERATOR=cpu``, gloo, 2 ranks under torchrun), watched as
``deepspeed.initialize`` returns it: ``watch(engine, engine.optimizer)``. Under ZeRO-1/2/3 the
gradients live in DeepSpeed's partitions (``param.grad`` is None): the per-block norms read from
them are exact against an fp64 reference (under ZeRO-3 the update ratio read from the parameter
partitions too, against the gathered parameters), the total equals the engine's own
``get_global_grad_norm()`` (before its clipping), a NaN on one rank is skipped by both ranks in
that step, and the next step is a healthy one. With ZeRO off (stage 0) the engine clips with
its own ``clip_grad_norm_``: the norms are still the ones before it. With ``checkpoint_dir``
(ZeRO-0/1/2/3 raw, ZeRO-2 through the Trainer) a NaN rolls both ranks back and a restart
resumes: each rank's own partition of the optimizer state (under ZeRO-3 of the parameters too)
comes back exactly, and the step after a rollback repeats the losses of the first run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import deepspeed  # noqa: F401  (a missing DeepSpeed fails here, never skips)
import pytest
from real_steps import read_ranks
from real_steps import torchrun as _torchrun

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_gradients_are_read_from_the_partitions_exactly_and_a_nan_is_that_steps_skip(
    tmp_path, stage
):
    fault, steps = 5, 10
    done = _torchrun(
        HERE / "deepspeed_job.py",
        tmp_path,
        str(tmp_path),
        "--stage",
        str(stage),
        "--fault-step",
        str(fault),
        "--steps",
        str(steps),
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = read_ranks(tmp_path)
    reports = ranks[0]["reports"]
    assert [r["action"] for r in reports] == ["step"] * (fault - 1) + ["skip"] + ["step"] * (
        steps - fault
    )
    assert "nonfinite_loss" in reports[fault - 1]["verdicts"]
    assert not [
        r["verdicts"]
        for r in reports
        if any(v.startswith("dead_") or v == "vanishing_gradients" for v in r["verdicts"])
    ]
    clip = ranks[0]["clip"]
    for report in reports:
        if report["action"] != "step":
            continue
        for block, norm in report["grad_norm"].items():
            assert norm > 0 and norm == pytest.approx(report["ref"][block], rel=2e-6), block
        reference = math.sqrt(sum(v * v for v in report["ref"].values()))
        assert report["grad_norm_total"] == pytest.approx(reference, rel=2e-6)
        if stage:  # ZeRO's own norm (ZeRO off, the engine keeps none)
            assert report["grad_norm_total"] == pytest.approx(report["engine_norm"], rel=1e-6)
        assert math.isfinite(report["loss"])
    assert any(r["grad_norm_total"] > clip * 1.1 for r in reports), "the norms are not pre-clip"
    for rank in ranks:  # DeepSpeed clipped: each real step's gradient was at most clip
        assert all(n <= clip * (1 + 1e-5) for n in rank["real"])
        # One real step per healthy step (ZeRO steps its torch optimizer once per param group,
        # ZeRO-3 once per sub-group: two here)
        assert len(rank["real"]) == (steps - 1) * (2 if stage else 1)
    assert ranks[0]["params"] == ranks[1]["params"]
    if stage == 3:
        # Sampled every step: step s carries the ratio of the update applied at step s - 1,
        # which the job measured on the whole (gathered) parameters; the skip applied none.
        measured = [r for r in reports if r["update_ratio"]]
        assert len(measured) == steps - 2  # not step 1 (no update before it), nor step 6
        assert fault + 1 not in [r["step"] for r in measured]  # (the skip applied none)
        for report in measured:
            applied = reports[report["update_ratio_step"] - 1]
            assert applied["action"] == "step"
            for block, ratio in report["update_ratio"].items():
                assert ratio > 1e-4 and ratio == pytest.approx(
                    applied["ref_update_ratio"][block], rel=1e-5
                ), block


def test_the_deepspeed_example_runs(tmp_path):
    done = _torchrun(
        ROOT / "examples" / "deepspeed_train.py", tmp_path, "--stage", "2", "--steps", "6"
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("step 6 step")]
    assert line, done.stdout[-3000:]
    ours, theirs = float(line[0].split("grad_norm ")[1].split()[0]), float(line[0].split()[-1])
    assert ours == pytest.approx(theirs, abs=2e-4)


@pytest.mark.parametrize("stage", [1, 3])  # stage 2 through the Trainer: the rollback test
def test_the_trainer_with_a_deepspeed_config_is_watched_by_the_callback_unchanged(tmp_path, stage):
    fault, steps = 5, 10
    done = _torchrun(
        HERE / "hf_deepspeed_job.py",
        tmp_path,
        str(tmp_path),
        "--stage",
        str(stage),
        "--fault-step",
        str(fault),
        "--steps",
        str(steps),
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["step"], r["action"]) for r in ranks[0]["reports"]] == [
        (r["step"], r["action"]) for r in ranks[1]["reports"]
    ], "the ranks decided differently"
    reports = ranks[0]["reports"]
    # The NaN is injected at global_step == fault, i.e. in the Trainer's step fault + 1.
    assert [r["action"] for r in reports] == ["step"] * fault + ["skip"] + ["step"] * (
        steps - fault - 1
    )
    assert ranks[0]["global_step"] == steps
    assert not [r["verdicts"] for r in reports if any(v.startswith("dead_") for v in r["verdicts"])]
    for report, engine in zip(reports, ranks[0]["engine_norms"]):
        if report["action"] == "step":
            assert report["grad_norm_total"] == pytest.approx(engine, rel=1e-6)
            assert all(v > 0 for v in report["grad_norm"].values())
            assert math.isfinite(report["loss"])
    assert any(r["grad_norm_total"] > ranks[0]["clip"] for r in reports), "not the pre-clip norm"


# Stage 1 checkpoints through the same optimizer and partition state as stage 2 (only its
# gradients are not partitioned: the exactness test above covers that): not run again here.
@pytest.mark.parametrize(
    "stage, gathered",
    [(0, ()), (2, ()), (3, ()), (3, ("--persistence-threshold", "0"))],
    ids=["0", "2", "3", "3-none-persistent"],
)
def test_a_nan_rolls_both_ranks_back_and_a_restart_resumes_the_partitioned_optimizer_state(
    tmp_path, stage, gathered
):
    """ZeRO-1/2 keeps each rank's partition of the optimizer (its fp32 master slice, Adam's
    moments over it) apart, ZeRO-3 each rank's partition of the parameters too (kept whole
    between steps when small, DeepSpeed's default, or gathered at each forward): a rollback
    and a restart bring back each rank's own, exactly."""
    job = HERE / "deepspeed_job.py"
    done = _torchrun(
        job,
        tmp_path,
        str(tmp_path),
        "--stage",
        str(stage),
        *gathered,
        "--fault-step",
        "8",
        "--steps",
        "10",
        "--checkpoint-every",
        "3",
        job_id=f"zero-{stage}",
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = read_ranks(tmp_path)
    reports = ranks[0]["reports"]
    rollbacks = [r for r in reports if r["action"] == "rollback"]
    # The NaN at step 8 rolls back to step 6, over a step (7) that changed every partition.
    assert len(rollbacks) == 1 and rollbacks[0]["step"] == 8
    assert rollbacks[0]["rollback"]["to_step"] == 6 and rollbacks[0]["rollback"]["lr_scale"] == 0.5
    at = reports.index(rollbacks[0])
    after = reports[at + 1 :]
    assert after and all(
        r["action"] == "step" and r["lr"][0] == pytest.approx(1.5e-3) for r in after
    )
    assert all(math.isfinite(r["loss"]) for r in after)
    assert ranks[0]["params"] == ranks[1]["params"]
    for rank in ranks:  # the rollback brought back each rank's own step-6 state exactly
        assert rank["digests"]["rolled back"] == rank["digests"]["6"]
        assert rank["digests"]["3"] != rank["digests"]["6"]
        # The job draws step 7's micro-batches again after the rollback: on the restored step-6
        # weights they give exactly the losses step 7 computed the first time.
        assert rank["reports"][at + 1]["step"] == 7
        assert rank["reports"][at + 1]["losses"] == rank["reports"][6]["losses"]
    if stage:  # each rank holds its own partition: the states differ, and are not empty
        assert ranks[0]["digests"]["6"] != ranks[1]["digests"]["6"]
    # The same job started again: each rank resumes its own partition of the newest healthy
    # checkpoint (the state it had right after that step), with the back-off kept.
    again = _torchrun(
        job,
        tmp_path,
        str(tmp_path),
        "--stage",
        str(stage),
        *gathered,
        "--steps",
        "2",
        "--checkpoint-every",
        "3",
        job_id=f"zero-{stage}",
    )
    assert again.returncode == 0, (again.stdout + again.stderr)[-6000:]
    for r in range(2):
        first, second = ranks[r], json.loads((tmp_path / f"rank{r}.json").read_text())
        resumed = second["resumed"]
        newest = max(int(s) for s in first["digests"] if s.isdigit())
        assert resumed["step"] == newest
        assert resumed["digest"] == first["digests"][str(newest)], f"rank {r}'s partition"
        assert all(lr == pytest.approx(1.5e-3) for lr in second["reports"][0]["lr"])
        assert all(rep["action"] == "step" for rep in second["reports"])
        assert all(math.isfinite(rep["loss"]) for rep in second["reports"])
    if stage and not gathered:  # one rank cannot take two ranks' partitions: refused, never
        # half-loaded
        alone = _torchrun(
            job,
            tmp_path,
            str(tmp_path),
            "--stage",
            str(stage),
            *gathered,
            "--steps",
            "1",
            "--checkpoint-every",
            "3",
            job_id=f"zero-{stage}",
            nproc=1,
        )
        assert alone.returncode != 0
        missing = "model" if stage == 3 else "optim"
        assert (
            f"Missing key in checkpoint state_dict: {missing}.zero-rank-00000-of-00001"
            in alone.stdout + alone.stderr
        )


@pytest.mark.parametrize("stage", [2, 3])
def test_the_trainer_with_deepspeed_zero_rolls_both_ranks_back_to_their_own_partitions(
    tmp_path, stage
):
    """The Trainer's ZeRO-2/3 run with ``checkpoint_dir``: the NaN at one micro-batch of one
    rank rolls both ranks back to the last healthy checkpoint, and the Trainer's scheduler goes
    on from the restored step at half the learning rate."""
    done = _torchrun(
        HERE / "hf_deepspeed_job.py",
        tmp_path,
        str(tmp_path),
        "--stage",
        str(stage),
        "--fault-step",
        "5",
        "--steps",
        "10",
        "--checkpoint-every",
        "2",
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["reports"] == ranks[1]["reports"], "the ranks decided or measured differently"
    reports = ranks[0]["reports"]
    actions = [(r["step"], r["action"]) for r in reports]
    assert actions == [(s, "step") for s in range(1, 6)] + [(6, "rollback")] + [
        (s, "step") for s in range(5, 9)
    ]
    assert reports[5]["rollback"]["to_step"] == 4 and reports[5]["rollback"]["lr_scale"] == 0.5
    lr_at = {r["step"]: r["lr"][0] for r in reports[:5]}
    for report, engine in zip(reports, ranks[0]["engine_norms"]):
        if report["action"] == "step":  # the engine's own norm, before it clipped
            assert math.isfinite(report["loss"])
            assert report["grad_norm_total"] == pytest.approx(engine, rel=1e-6)
            assert all(v > 0 for v in report["grad_norm"].values())
    assert any(r["grad_norm_total"] > ranks[0]["clip"] for r in reports), "not the pre-clip norm"
    assert reports[6]["lr"][0] == pytest.approx(0.5 * lr_at[5], rel=1e-6)
