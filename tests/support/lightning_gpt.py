"""examples/lightning_ddp.py's LightningModule, loader and Trainer, for the Lightning tests.

    from support.lightning_gpt import GPTModule, loader, trainer

The same module the example trains (AdamW, warmup + cosine stepped every optimizer step), kept
here because tests never import from ``examples/``; tests/integration/test_examples.py runs the
example itself.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from support.models import TinyGPT, random_batches

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

    def configure_optimizers(self) -> dict:
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
