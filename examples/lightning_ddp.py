"""Lightning with DDP, torchvitals watching every rank: one callback is the only change.

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --out runs/lightning
    python examples/lightning_ddp.py --devices 1 --out runs/lightning

Lightning keeps everything it owns: the loop, the scheduler (stepped every optimizer step), the
gradient clipping (``gradient_clip_val``), the gradient accumulation and its checkpoints.
torchvitals measures each step before Lightning clips, agrees on it with every rank, and steps,
skips or rolls back every rank together.
"""

from __future__ import annotations

import argparse
import math
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchvitals
from torchvitals.agent.tools.demo.data import random_batches
from torchvitals.agent.tools.demo.model import TinyGPT

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="torchvitals_runs/lightning")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    args = parser.parse_args()
    pl.seed_everything(0, workers=True)
    vitals = torchvitals.LightningCallback(
        checkpoint_dir=os.path.join(args.out, "ckpt"),
        log_dir=args.out,
        run_name="events",
        metrics_port=0,
    )
    trainer(args.out, args.steps, args.devices, [vitals]).fit(
        GPTModule(total_steps=args.steps), loader(4000)
    )
    report = vitals.last_report
    if trainer_rank() == 0 and report is not None:
        print(
            f"step {report.step}: loss {report.loss:.3f}, lr {report.lr[0]:.2e}, "
            f"grad norm (before clipping) {report.grad_norm_total:.3f}"
        )


def trainer_rank() -> int:
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    main()
