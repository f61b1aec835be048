"""On a GPU: the Hugging Face Trainer with ``fp16=True`` (accelerate's GradScaler) under the
agent. accelerate swaps the optimizer's ``step`` for its own for the length of each step and
steps the scheduler only when that swapped-in method ran; the guard must route the scaler's
step through the agent, go through accelerate's method for the real step, and leave the
schedule and the training as they are without torchvitals.

These tests exist only where CUDA is available (accelerate refuses fp16 on the CPU); run them
on a GPU machine with ``python -m pytest tests/integration/test_cuda_frameworks.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.frameworks, pytest.mark.cuda]

DEVICES = ["cuda"] if torch.cuda.is_available() else []
STEPS = 40


def _hf_fp16(tmp_path, tag: str, callbacks: list):
    from transformers import Trainer

    from torchvitals.agent.tools.examples.hf_gpt2 import Arithmetic, arguments, tiny_gpt2

    trainer = Trainer(
        model=tiny_gpt2(0),
        args=arguments(str(tmp_path / tag), STEPS, use_cpu=False, fp16=True, logging_steps=5),
        train_dataset=Arithmetic(4000, seed=0),
        callbacks=callbacks,
    )
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, losses


@pytest.mark.parametrize("device", DEVICES)
def test_hf_trainer_fp16_steps_through_the_agent_and_keeps_its_schedule(device, tmp_path):
    import torchvitals

    bare, bare_losses = _hf_fp16(tmp_path, "bare", [])
    hf = torchvitals.TransformersCallback(log_dir="", metrics_port=0)
    watched, losses = _hf_fp16(tmp_path, "watched", [hf])
    assert watched.state.global_step == STEPS and hf.last_report.step == STEPS
    # The scheduler stepped exactly as without torchvitals: accelerate saw every real step.
    assert watched.lr_scheduler.get_last_lr() == bare.lr_scheduler.get_last_lr()
    assert watched.accelerator.scaler.get_scale() == bare.accelerator.scaler.get_scale()
    assert losses == pytest.approx(bare_losses, rel=1e-3)
    assert hf.last_report.loss_scale == watched.accelerator.scaler.get_scale()
    assert not [v for v in hf.verdicts if v.severity == "critical"], [str(v) for v in hf.verdicts]


@pytest.mark.parametrize("device", DEVICES)
def test_hf_trainer_fp16_rollback_restores_the_schedule_with_the_model(device, tmp_path):
    """A NaN loss at step 25 rolls back to the step-20 checkpoint; accelerate reports that step
    as skipped, and the Trainer must still step the restored scheduler, as it does in fp32."""
    import sys
    from pathlib import Path

    from transformers import Trainer, TrainerCallback

    import torchvitals
    from torchvitals.agent.tools.examples.hf_gpt2 import Arithmetic, arguments, tiny_gpt2

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_job import CLIP, Record

    epochs: list[int] = []

    class Epochs(TrainerCallback):
        def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
            epochs.append(lr_scheduler.last_epoch)

    vitals = torchvitals.TransformersCallback(
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=10,
        healthy_window=3,
        log_dir="",
        metrics_port=0,
        # the first steps' overflows must not keep the
        # step-20 checkpoint from being healthy
        detect={"overflow_skips": 1000},
    )
    model = tiny_gpt2()
    record = Record(vitals, model, rank=1, fault_step=25)  # rank 1: the rank that faults
    trainer = Trainer(
        model=model,
        args=arguments(
            str(tmp_path / "hf"),
            40,
            max_grad_norm=CLIP,
            logging_steps=1000,
            use_cpu=False,
            fp16=True,
        ),
        train_dataset=Arithmetic(2000),
        callbacks=[vitals, record, Epochs()],
    )
    trainer.train()
    reports = record.reports
    rollbacks = [i for i, r in enumerate(reports) if r["action"] == "rollback"]
    assert len(rollbacks) == 1 and reports[rollbacks[0]]["rollback"]["to_step"] == 20
    saved = next(i for i, r in enumerate(reports) if r["step"] == 20 and r["action"] == "step")
    assert epochs[rollbacks[0]] == epochs[saved], "the scheduler is back where step 20 left it"
    assert len(record.real) == sum(r["action"] == "step" for r in reports)
    after = [r for r in reports[rollbacks[0] + 1 :] if r["action"] == "step"]
    assert after and all(
        real["lr"] == pytest.approx(r["lr"][0])
        for real, r in zip(record.real[-len(after) :], after)
    )
