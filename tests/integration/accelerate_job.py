"""examples/accelerate_loop.py's loop, recorded, with a NaN loss on one rank at one micro-batch,
for tests/integration/test_accelerate.py.

    torchrun --standalone --nproc-per-node 2 tests/integration/accelerate_job.py OUT --fault-step 12

``watch()`` gets what ``accelerator.prepare`` returns. Each rank writes ``OUT/rank<r>.json``:
every report at a synchronised step, accelerate's own pre-clip norm for it, the micro-batch
losses, every real step of the inner optimizer (from its own pre-step hook), the scheduler's LR
and the final parameters.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate import Accelerator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]  # real_steps
import torchvitals  # noqa: E402
from torchvitals.agent.tools.demo.regression import micro_batches as batches  # noqa: E402
from torchvitals.agent.tools.demo.regression import mlp  # noqa: E402

ACCUMULATE, CLIP = 2, 0.5
"""As examples/accelerate_loop.py trains."""


def build() -> tuple:
    """examples/accelerate_loop.py's model, AdamW and warmup schedule."""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    return (
        model,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10)),
    )


from real_steps import describe, exit_after, finish, record_real_steps  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=True)
    rank = accelerator.process_index
    model, optimizer, scheduler = accelerator.prepare(*build())
    agent = torchvitals.watch(
        model,
        optimizer,
        scheduler,
        log_dir="",
        metrics_port=0,
        checkpoint_dir=os.path.join(args.out, "ckpt"),
        checkpoint_every=5,
    )
    real: list[dict] = []
    record_real_steps(optimizer.optimizer, real)
    reports, clip_norms, micro, sched_lr, syncs = [], [], [], [], 0
    for i, (x, y) in enumerate(batches(args.steps * ACCUMULATE, seed=rank)):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            micro.append(loss.item())
            if rank == 1 and i == args.fault_step * ACCUMULATE + 1:
                loss = loss * float("nan")  # the second micro-batch of step fault_step
            agent.record_loss(loss.detach())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                syncs += 1
                clip_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                sched_lr.append(scheduler.get_last_lr()[0])
            before = agent.last_report
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                assert agent.last_report is not before, "a synchronised step went unmeasured"
                reports.append(describe(agent.last_report))
            else:
                assert agent.last_report is before, "a micro-step was taken as a step"
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    finish(
        agent,
        os.path.join(args.out, f"rank{rank}.json"),
        {
            "reports": reports,
            "clip_norms": clip_norms,
            "micro_losses": micro,
            "real": real,
            "sched_lr": sched_lr,
            "syncs": syncs,
            "accumulate": ACCUMULATE,
            "params": flat.tolist(),
            "lr_scale": agent.lr_scale,
        },
    )


if __name__ == "__main__":
    exit_after(main)
