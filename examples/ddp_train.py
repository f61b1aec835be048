"""Train the small GPT with DDP under torchrun, torchvitals watching every rank.

    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 200
    torchvitals supervise --checkpoint-dir ckpt -- torchrun --nproc-per-node 2 examples/ddp_train.py

The job the Docker Compose demo and the Helm chart's example PyTorchJob run. Everything the
agent needs comes from the environment (``TORCHVITALS_CHECKPOINT_DIR``, ``_METRICS_HOST``,
``_COLLECTOR_URL``, ``_COLLECTOR_JOB``, ``TORCHVITALS_WEBHOOK_TOKEN``...), so a deployment
configures it without touching the script. NCCL on GPUs, gloo on CPUs. ``--steps 0`` trains until
stopped. Each rank draws its own deterministic batches (``seed=rank``), so a restarted job
resumed from a healthy checkpoint replays the same stream.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.distributed as dist

import torchvitals
from torchvitals.agent.tools.demo.data import random_batches
from torchvitals.agent.tools.demo.model import TinyGPT

MODEL = dict(vocab=128, d_model=128, n_layers=4, n_heads=4, seq_len=64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="0: train until stopped")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="seconds to pause after each step (to watch live)"
    )
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    try:
        torch.manual_seed(0)
        model = TinyGPT(**MODEL).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if cuda else None
        )
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        # The deployment decides (TORCHVITALS_RESUME): the chart's job says "restart", continued
        # by its job id after a new pod or a new supervisor and refused to another job; run by
        # hand (and in the compose demo), a job continues the folder it finds.
        agent = torchvitals.watch(
            ddp, optimizer, resume=os.environ.get("TORCHVITALS_RESUME", "auto")
        )
        if agent.resumed_from is not None and rank == 0:
            print(f"resumed from step {agent.resumed_from}", flush=True)
        # An endless, repeatable stream: agent.batches() counts its position, so a rollback or
        # a restart skips exactly the batches the ledger says to.
        stream = (
            batch
            for epoch in itertools.count()
            for batch in random_batches(
                1000,
                batch=args.batch,
                seq_len=MODEL["seq_len"],
                vocab=MODEL["vocab"],
                seed=1000 * epoch + rank,
            )
        )
        for inputs, targets in agent.batches(stream):
            loss = _loss(ddp, inputs.to(device), targets.to(device))
            loss.backward()
            report = agent.step(loss, samples=inputs.shape[0])
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and (report.step % 20 == 0 or report.action != "step"):
                print(
                    f"step {report.step} loss {report.loss:.4f} action {report.action}", flush=True
                )
            if args.sleep:
                time.sleep(args.sleep)
            if args.steps and agent.step_count >= args.steps:
                break
        agent.close()
    finally:
        dist.destroy_process_group()
    return 0


def _loss(ddp: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Through the DDP wrapper's forward, so its gradient all-reduce hooks run.
    logits = ddp(inputs)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )


if __name__ == "__main__":
    sys.exit(main())
