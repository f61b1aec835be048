"""torchvitals in the frameworks users train with, the real ones, under torchrun with 2 gloo ranks:
a NaN loss on one rank at one batch rolls back every rank in the same step, the run finishes,
the real optimizer steps match what the framework counts, its scheduler and clipping keep
acting, and the learning rate after the rollback is the backed-off one."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

pytestmark = pytest.mark.frameworks

HERE = Path(__file__).resolve().parent


def torchrun(script: Path, out: Path, *args: str, timeout: int = 400) -> list[dict]:
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
            str(script),
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
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def check_one_rollback_everywhere(ranks: list[dict], fault_step: int) -> list[dict]:
    """Same decisions on both ranks, one rollback at the faulty step, the run finished."""
    actions = [[(r["step"], r["action"]) for r in rank["reports"]] for rank in ranks]
    assert actions[0] == actions[1], "the ranks took different decisions"
    reports = ranks[0]["reports"]
    rollbacks = [r for r in reports if r["action"] == "rollback"]
    assert len(rollbacks) == 1, [r["verdicts"] for r in rollbacks]
    assert rollbacks[0]["step"] == fault_step + 1 and rollbacks[0]["rollback"]["to_step"] == 20
    assert rollbacks[0]["rollback"]["lr_scale"] == 0.5
    assert {"nonfinite_loss", "nonfinite_grad"} & set(rollbacks[0]["verdicts"])
    for rank in ranks:
        # Every optimizer.step() the framework made became one real step, or a skip/rollback
        # the report says: never two, never one the agent did not see.
        stepped = sum(r["action"] == "step" for r in rank["reports"])
        assert len(rank["real"]) == stepped
        assert rank["global_step"] == len(rank["reports"])
    assert all(math.isfinite(r["loss"]) for r in reports if r["action"] == "step")
    return reports


def check_lr_and_clipping(rank: dict, reports: list[dict], fault_step: int) -> None:
    steps = [r for r in reports if r["action"] == "step"]
    for real, report in zip(rank["real"], steps):
        assert real["lr"] == pytest.approx(report["lr"][0], rel=1e-9)  # what it stepped with
        assert real["grad_norm"] <= rank["clip"] * (1 + 1e-4)  # the framework clipped
    assert any(r["grad_norm_total"] > rank["clip"] * 1.5 for r in steps), (
        "the reported norms should be the pre-clip ones"
    )
    after = [(i, r) for i, r in enumerate(reports) if r["action"] == "step" and i > fault_step]
    assert after
    for i, report in after:
        # The rollback restored the scheduler with the model: the framework's scheduler at the
        # model's step, backed off by half.
        expected = 0.5 * rank["base_lr"] * rank["lr_lambda"][report["step"] - 1]
        assert report["lr"][0] == pytest.approx(expected, rel=1e-6), (i, report["step"])


@pytest.mark.distributed
def test_lightning_ddp_rolls_back_every_rank_and_keeps_its_scheduler_and_clipping(tmp_path):
    fault_step = 25
    ranks = torchrun(
        HERE / "lightning_job.py", tmp_path, "--fault-step", str(fault_step), "--steps", "50"
    )
    reports = check_one_rollback_everywhere(ranks, fault_step)
    assert ranks[0]["global_step"] == 50
    check_lr_and_clipping(ranks[0], reports, fault_step)
    # The reported loss is the true mean over both ranks and both accumulated micro-batches.
    k = ranks[0]["accumulate"]
    for i, report in enumerate(reports[:fault_step]):
        mean = sum(sum(rank["micro_losses"][k * i : k * i + k]) / k for rank in ranks) / 2
        assert report["loss"] == pytest.approx(mean, rel=1e-5), i


@pytest.mark.distributed
def test_hf_trainer_rolls_back_every_rank_and_keeps_its_scheduler_and_clipping(tmp_path):
    fault_step = 25
    ranks = torchrun(HERE / "hf_job.py", tmp_path, "--fault-step", str(fault_step), "--steps", "50")
    reports = check_one_rollback_everywhere(ranks, fault_step)
    assert ranks[0]["global_step"] == 50
    check_lr_and_clipping(ranks[0], reports, fault_step)
    # GPT-2 normalises each micro-batch's summed token loss by the tokens of the whole step on
    # every rank (num_items_in_batch): the step's mean loss is the sum of all those shares.
    k = ranks[0]["accumulate"]
    for i, report in enumerate(reports[:fault_step]):
        total = sum(sum(rank["micro_losses"][k * i : k * i + k]) for rank in ranks)
        assert report["loss"] == pytest.approx(total, rel=1e-5), i


@pytest.mark.distributed
def test_hf_trainer_step_its_optimizer_skipped_is_that_steps_skip_on_both_ranks(tmp_path):
    """The Trainer's optimizer skips the step itself on non-finite gradients (rank 1's loss is
    NaN at one micro-batch; DDP spreads it to both ranks) and the Trainer then clears the
    gradients with ``model.zero_grad()`` on accelerate's DDP wrapper: that step is reported as
    its own skip on both ranks, the next one reports its own loss and the Trainer's own pre-clip
    gradient norm, and no healthy step is lost (no rollback, every other step stepped)."""
    fault_step, steps = 12, 30
    ranks = torchrun(
        HERE / "hf_job.py",
        tmp_path,
        "--fault-step",
        str(fault_step),
        "--steps",
        str(steps),
        "--framework-skip",
    )
    actions = [[(r["step"], r["action"]) for r in rank["reports"]] for rank in ranks]
    assert actions[0] == actions[1], "the ranks took different decisions"
    assert actions[0] == [
        (s, "skip" if s == fault_step + 1 else "step") for s in range(1, steps + 1)
    ]
    reports = ranks[0]["reports"]
    assert {"nonfinite_loss", "nonfinite_grad"} <= set(reports[fault_step]["verdicts"])
    k = ranks[0]["accumulate"]
    for i, report in enumerate(reports):
        if report["action"] != "step":
            continue
        total = sum(sum(rank["micro_losses"][k * i : k * i + k]) for rank in ranks)
        assert report["loss"] == pytest.approx(total, rel=1e-5), i
        trainers = ranks[0]["trainer_grad_norm"][str(report["step"])]
        assert report["grad_norm_total"] == pytest.approx(trainers, rel=1e-5), i
    for rank in ranks:
        assert rank["skipped_by_optimizer"] == 1
        assert len(rank["real"]) == steps - 1 and rank["global_step"] == steps


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_runs_in_both_frameworks_raise_nothing(tmp_path, seed):
    """200 healthy steps in each framework (one process): no verdict at all, nothing rolled back."""
    import lightning.pytorch as pl
    from transformers import Trainer

    import torchvitals
    from torchvitals.agent.tools.examples.hf_gpt2 import Arithmetic, arguments, tiny_gpt2
    from torchvitals.agent.tools.examples.lightning_gpt import GPTModule, loader, trainer

    pl.seed_everything(seed)
    lightning = torchvitals.LightningCallback(log_dir="", metrics_port=0)
    trainer(str(tmp_path / "pl"), 200, 1, [lightning]).fit(
        GPTModule(total_steps=200), loader(4000, seed=seed)
    )
    hf = torchvitals.TransformersCallback(log_dir="", metrics_port=0)
    Trainer(
        model=tiny_gpt2(seed),
        args=arguments(str(tmp_path / "hf"), 200, seed=seed, logging_steps=1000),
        train_dataset=Arithmetic(8000, seed=seed),
        callbacks=[hf],
    ).train()
    for callback in (lightning, hf):
        assert callback.last_report.step == 200 and callback.last_report.action == "step"
        assert not callback.verdicts, [str(v) for v in callback.verdicts]
    assert lightning.last_report.loss < 2.0 and hf.last_report.loss < 2.0
    for callback in (lightning, hf):  # the time between batches reached the agent
        assert 0 < callback.last_report.timing.data_wait_seconds < 1.0


def _lightning_fp16(callbacks: list, tmp_path: Path, tag: str) -> tuple[list, list, float]:
    """Lightning's own 16-mixed plugin (fp16 autocast + GradScaler) on CPU, 30 optimizer steps,
    a scaler starting at 2^30 so the first steps overflow as a real fp16 run's first steps do.
    Returns (the module's losses, the final weights, the final scale)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    from torchvitals.agent.tools.examples.lightning_gpt import GPTModule, loader

    class Recorded(GPTModule):
        losses: ClassVar[list] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(float(loss.detach()))
            return loss

    pl.seed_everything(0)
    module = Recorded(total_steps=30)
    module.losses = []
    plugin = MixedPrecision(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**30)
    )
    pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=30,
        gradient_clip_val=1.0,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path / tag),
        callbacks=callbacks,
    ).fit(module, loader(2000))
    return (
        module.losses,
        [p.detach().clone() for p in module.parameters()],
        plugin.scaler.get_scale(),
    )


def test_lightning_16_mixed_overflow_steps_reach_the_agent_and_training_is_unchanged(tmp_path):
    """Lightning's scaler skips overflow steps inside ``scaler.step``; routed through the guard,
    each is measured, reported as an overflow skip and counted, and the run is bit for bit the
    run without torchvitals."""
    import torch

    import torchvitals

    ref_losses, ref_params, ref_scale = _lightning_fp16([], tmp_path, "bare")
    seen = []

    class Seen(__import__("lightning.pytorch").pytorch.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(vitals.agent.last_report)

    vitals = torchvitals.LightningCallback(log_dir="", metrics_port=0)
    losses, params, scale = _lightning_fp16([vitals, Seen()], tmp_path, "watched")
    assert losses == ref_losses and scale == ref_scale
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert [r.step for r in seen] == list(range(1, 31)), "every optimizer step reached the agent"
    overflowed = [r.step for r in seen if r.overflow]
    assert overflowed[:3] == [1, 2, 3] and len(overflowed) >= 11, overflowed
    assert all(r.action == ("skip" if r.overflow else "step") for r in seen)
    assert [v.pattern for v in vitals.verdicts] == ["fp16_overflow"]
    # The loss Lightning's hook hands over is the scaled one; the report holds the real loss.
    for report, loss in zip(seen, losses):
        assert report.loss == pytest.approx(loss, rel=1e-3)
    for report, after in itertools.pairwise(seen):  # each overflow halved the scale, nothing else
        assert after.loss_scale == report.loss_scale / (2 if report.overflow else 1)


def test_a_restart_under_lightning_continues_the_schedule_where_it_stopped(tmp_path):
    """The checkpoint is taken inside Lightning's optimizer.step(), before Lightning steps the
    scheduler for that step; a restart from it must run the rest of the schedule at the same
    learning rates as the run that never stopped, not one step behind."""
    import lightning.pytorch as pl
    from real_steps import record_real_steps

    import torchvitals
    from torchvitals.agent.tools.examples.lightning_gpt import GPTModule, loader

    def fit(steps: int, callbacks: list) -> list[float]:
        real: list[dict] = []

        class Record(pl.Callback):
            def on_fit_start(self, trainer, pl_module):
                record_real_steps(trainer.optimizers[0], real)

        pl.seed_everything(0)
        pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
            callbacks=[*callbacks, Record()],
        ).fit(GPTModule(total_steps=30), loader(2000))
        return [r["lr"] for r in real]

    whole = fit(30, [])
    ckpt = dict(
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=10,
        healthy_window=0,
        log_dir="",
        metrics_port=0,
    )
    first = fit(20, [torchvitals.LightningCallback(**ckpt)])
    assert first == whole[:20]
    resumed = torchvitals.LightningCallback(resume="auto", **ckpt)
    second = fit(10, [resumed])
    assert resumed.last_report.step == 30
    assert second == pytest.approx(whole[20:], rel=1e-12)


def test_a_restart_under_the_hf_trainer_continues_the_schedule_where_it_stopped(tmp_path):
    """As for Lightning: the same command run again after 20 steps (the Trainer's own step count
    starts over, torchvitals' model step does not) steps at the uninterrupted run's rates."""
    from real_steps import record_real_steps
    from transformers import Trainer, TrainerCallback

    import torchvitals
    from torchvitals.agent.tools.examples.hf_gpt2 import Arithmetic, arguments, tiny_gpt2

    def fit(stop_after: int, callbacks: list) -> list[float]:
        real: list[dict] = []

        class Record(TrainerCallback):
            def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
                record_real_steps(getattr(optimizer, "optimizer", optimizer), real)

            def on_step_end(self, args, state, control, **kwargs):
                control.should_training_stop = state.global_step >= stop_after

        Trainer(
            model=tiny_gpt2(0),
            args=arguments(str(tmp_path / "hf"), 30, logging_steps=1000),
            train_dataset=Arithmetic(4000),
            callbacks=[*callbacks, Record()],
        ).train()
        return [r["lr"] for r in real]

    whole = fit(30, [])
    ckpt = dict(
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=10,
        healthy_window=0,
        log_dir="",
        metrics_port=0,
    )
    assert fit(20, [torchvitals.TransformersCallback(**ckpt)]) == whole[:20]
    resumed = torchvitals.TransformersCallback(resume="auto", **ckpt)
    second = fit(10, [resumed])
    assert resumed.last_report.step == 30
    assert second == pytest.approx(whole[20:], rel=1e-12)
