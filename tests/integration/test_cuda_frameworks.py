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

DEVICES = ["cuda"] if torch.cuda.is_available() else []
STEPS = 40


def _hf_fp16(tmp_path, tag: str, callbacks: list):
    from transformers import Trainer

    from hf_trainer import Arithmetic, arguments, tiny_gpt2

    trainer = Trainer(model=tiny_gpt2(0),
                      args=arguments(str(tmp_path / tag), STEPS, use_cpu=False, fp16=True,
                                     logging_steps=5),
                      train_dataset=Arithmetic(4000, seed=0), callbacks=callbacks)
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
