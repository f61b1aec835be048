"""A hand-written Accelerate loop with torchvitals: pass ``watch()`` what ``prepare`` returns.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --steps 40

The loop stays accelerate's: ``accumulate``, ``backward``, ``clip_grad_norm_``, then
``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``. torchvitals guards the
torch optimizer inside accelerate's ``AcceleratedOptimizer``, so the step accelerate takes once
the gradients are synchronised is the one every rank measures, agrees on and steps, skips or
rolls back together; ``record_loss`` gives it each micro-batch's loss, and the norms it reports
are the ones measured before ``clip_grad_norm_`` scaled the gradients.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchvitals
from torchvitals.agent.tools.demo.regression import micro_batches, mlp

ACCUMULATE, CLIP = 2, 0.5


def build(
    lr: float = 0.05,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The model (the same initial weights on every rank), AdamW and a warmup schedule."""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    return model, optimizer, scheduler


def batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` micro-batches of a smooth regression task (each rank its own seed)."""
    return micro_batches(n, seed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-dir", default="")
    args = parser.parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATE, cpu=not torch.cuda.is_available()
    )
    model, optimizer, scheduler = accelerator.prepare(*build())
    # What prepare returned, as it returned it: the guard goes on the optimizer inside.
    agent = torchvitals.watch(
        model, optimizer, scheduler, checkpoint_dir=args.checkpoint_dir or None, metrics_port=0
    )
    report = None
    for x, y in batches(args.steps * ACCUMULATE, seed=accelerator.process_index):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(
                model(x.to(accelerator.device)), y.to(accelerator.device)
            )
            agent.record_loss(loss.detach())  # each micro-batch; the step's is their mean
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()  # a no-op until the gradients are synchronised
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            report = agent.last_report
    if accelerator.is_main_process and report is not None:
        print(
            f"step {report.step} {report.action} loss {report.loss:.4f} "
            f"grad_norm {report.grad_norm_total:.4f} (before clipping to {CLIP})"
            + ("" if math.isfinite(report.loss) else " (non-finite)")
        )
    agent.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
