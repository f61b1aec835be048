"""A framework run that raises mid-training leaves no torchvitals patch behind: Lightning's
``on_exception`` closes the agent at once; the Hugging Face Trainer has no exception event, and
its failed run's agent, with every patch, goes when the Trainer is collected, even while the
callback is kept. In-process, a few seconds each.

    python -m pytest tests/integration/test_frameworks_patches.py -q
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad

import torchvitals
from torchvitals.agent import patches

SCALER_STEP = torch.amp.GradScaler.step
SCALE_GRADS = clip_grad._clip_grads_with_norm_
MODULE_ZERO_GRAD = nn.Module.zero_grad


class Boom(RuntimeError):
    """The failure the training step raises on purpose."""


def restored() -> bool:
    return (
        torch.amp.GradScaler.step is SCALER_STEP
        and clip_grad._clip_grads_with_norm_ is SCALE_GRADS
        and torch.nn.utils.clip_grads_with_norm_ is SCALE_GRADS
        and nn.Module.zero_grad is MODULE_ZERO_GRAD
        and patches.ZERO_GRAD._leases == 0
        and patches.SCALER_STEP._leases == 0
        and patches.CLIPPING._leases == 0
    )


def data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    return x, x.sum(1, keepdim=True)


def test_a_lightning_run_that_raises_takes_every_patch_with_it(tmp_path):
    """16-mixed (its GradScaler routed through the agent) with Lightning's clipping: every patch
    is used, then the training step raises at the fourth batch."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
            self.optimizer: torch.optim.Optimizer | None = None

        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                raise Boom("the fourth batch")
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            self.optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            return self.optimizer

    x, y = data(64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    vitals = torchvitals.LightningCallback(log_dir="", metrics_port=0)
    module = Net()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=20,
        gradient_clip_val=0.5,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[vitals],
    )
    with pytest.raises(Boom):
        trainer.fit(module, loader)
    assert vitals.last_report.step == 3 and vitals.agent is None
    assert restored(), "on_exception closed the agent"
    assert "step" not in vars(module.optimizer)


def test_an_hf_trainer_run_that_raises_leaves_no_patch_once_the_trainer_is_gone(tmp_path):
    """The Trainer clips (``max_grad_norm``) and steps through the guard, then the model raises
    at the fourth step. The callback, kept, still has the last report."""
    from transformers import Trainer, TrainingArguments

    class Net(nn.Module):
        def __init__(self, fail_at: int | None) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
            self.calls, self.fail_at = 0, fail_at

        def forward(self, x, labels):
            self.calls += 1
            if self.calls == self.fail_at:
                raise Boom("the fourth step")
            return {"loss": ((self.net(x) - labels) ** 2).mean()}

    x, y = data(128)
    dataset = [{"x": a, "labels": b} for a, b in zip(x, y)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=20,
        per_device_train_batch_size=8,
        learning_rate=0.05,
        max_grad_norm=0.5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        logging_strategy="no",
    )
    vitals = torchvitals.TransformersCallback(log_dir="", metrics_port=0)
    trainer = Trainer(model=Net(fail_at=4), args=args, train_dataset=dataset, callbacks=[vitals])
    try:
        trainer.train()
    except Boom:
        pass
    else:
        raise AssertionError("the model's fourth step raised")
    agent = weakref.ref(vitals.agent)
    assert agent() is not None and agent().step_count == 3 and not restored()
    assert vitals.last_report.step == 3
    # Training again with the same callback closes the failed run's agent first.
    Trainer(model=Net(fail_at=None), args=args, train_dataset=dataset, callbacks=[vitals]).train()
    assert agent() is not None and agent()._patches.closed and restored()
    assert vitals.last_report.step == 20
    del trainer
    gc.collect()
    assert agent() is None and vitals.agent is None
    assert restored()


def test_accelerates_fp16_step_swapping_the_optimizers_step_closes_quietly():
    """accelerate's fp16 ``step`` sets ``optimizer.step`` to its marker around ``scaler.step``
    and back to the step it saw before ``watch`` (here an LR scheduler's wrapper): the agent
    still sees every step, and ``close()`` takes that for the original put back, no warning."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    Accelerator(cpu=True)
    try:
        _accelerated_steps()
    finally:  # the next Trainer in this process builds its own state
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _accelerated_steps() -> None:
    import warnings

    from accelerate.optimizer import AcceleratedOptimizer

    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    before = vars(opt)["step"]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    accelerated = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)
    agent = torchvitals.watch(model, opt, scheduler, log_dir="", metrics_port=0)
    x, y = data(32)
    for batch in range(4):
        loss = ((model(x[batch::4]) - y[batch::4]) ** 2).mean()
        scaler.scale(loss).backward()
        accelerated.step()
        scheduler.step()
        accelerated.zero_grad()
    assert agent.step_count == 4 and agent.last_report.loss_scale == 2.0**4
    with warnings.catch_warnings():
        warnings.simplefilter("error", patches.ForeignPatchWarning)
        agent.close()
    assert vars(opt)["step"] is before and restored()
