"""The LightningModule, loader and Trainer that examples/lightning_ddp.py trains.

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --out runs/lightning
    from torchvitals.agent.tools.examples.lightning_gpt import GPTModule, loader, trainer
    trainer(out, steps=200, devices=1, callbacks=[vitals]).fit(GPTModule(), loader(4000))

The small GPT (``demo.model``) with AdamW and a warmup + cosine schedule stepped every optimizer
step, on synthetic token batches (``demo.data.random_batches``); the Trainer clips at 1.0 and
accumulates two micro-batches. Needs Lightning (``pip install "torchvitals[lightning]"``).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch.utils.data import DataLoader, TensorDataset

from ..demo.data import random_batches
from ..demo.model import TinyGPT

MODEL = dict(vocab=64, d_model=64, n_layers=3, n_heads=4, seq_len=32)


class GPTModule(pl.LightningModule):
    """The small GPT with AdamW and a warmup + cosine schedule stepped every optimizer step."""

    def __init__(self, lr: float = 3e-3, total_steps: int = 200) -> None:
        super().__init__()
        self.model = TinyGPT(**MODEL)
        self.lr, self.total_steps = lr, total_steps

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        return self.model.loss(x, y)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        warmup = 10

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / self.total_steps)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(n: int, seed: int = 0) -> DataLoader:
    xs, ys = zip(
        *random_batches(n, batch=1, seq_len=MODEL["seq_len"], vocab=MODEL["vocab"], seed=seed)
    )
    return DataLoader(
        TensorDataset(torch.cat(xs), torch.cat(ys)),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )


def trainer(out: str, steps: int, devices: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=steps,
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=callbacks,
    )
