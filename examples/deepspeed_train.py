"""A raw DeepSpeed loop with torchvitals: one line, ``watch(engine, engine.optimizer)``.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 \\
        examples/deepspeed_train.py --stage 2

(``deepspeed --num_gpus 2 examples/deepspeed_train.py`` on GPUs.) Under ZeRO-1/2 the gradients
live in DeepSpeed's partitioned buffers, not in ``param.grad``: torchvitals reads each rank's
fragment of every parameter's gradient there, and one SUM gives the exact per-block norms, before
DeepSpeed clips them (``gradient_clipping``). The agent's step runs around the ZeRO optimizer's
own: every rank steps, skips or rolls back together; with ``checkpoint_dir`` each rank's
partition of the optimizer state is checkpointed and restored with the model.
"""

from __future__ import annotations

import argparse
import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchvitals
from torchvitals.agent.tools.demo.regression import BLOCKS, deepspeed_config, micro_batch, mlp


def build() -> torch.nn.Module:
    """The same initial weights on every rank."""
    return mlp(named=True)


def config(stage: int, accumulate: int, clip: float) -> dict:
    return deepspeed_config(stage, accumulate, clip)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config(args.stage, 2, 1.0)
    )
    agent = torchvitals.watch(engine, engine.optimizer, blocks=BLOCKS, metrics_port=0)
    gen = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x, y = micro_batch(gen)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        agent.record_loss(loss.detach())
        engine.backward(loss)
        engine.step()  # at the accumulation boundary: the agent's step, then ZeRO's
    report = agent.last_report  # None only if no optimizer step ran
    if engine.global_rank == 0 and report is not None:
        print(
            f"step {report.step} {report.action} loss {report.loss:.4f} grad_norm "
            f"{report.grad_norm_total:.4f} deepspeed {float(engine.get_global_grad_norm()):.4f}"
        )
    agent.close()


if __name__ == "__main__":
    main()
