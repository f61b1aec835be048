"""A 2-rank training job under torchrun, watched by torchvitals, for the observability stack test.

    python -m torch.distributed.run --nproc-per-node 2 tests/integration/observed_job.py \
        --out OUT --stop STOPFILE --nan-at 120 [--ckpt CKPT] [--collector-url URL --job NAME]

A small transformer whose attention records its logits (so every dashboard panel has a signal),
trained with a CPU GradScaler (so the loss-scale panel has one too), one step every
``--step-sleep`` seconds until ``--stop`` exists or ``--max-steps`` loop iterations pass. Rank 1
makes its loss NaN once, at loop iteration ``--nan-at``. The metrics port comes from
TORCHVITALS_METRICS_PORT + LOCAL_RANK, as in any torchrun job. Rank 0 writes every report's step,
action and verdicts to ``--out`` (JSON) when the job ends.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchvitals

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in self.qkv(x).split(d, dim=2)
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // HEADS)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        torchvitals.record_attention(self, logits=scores)
        y = scores.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(rank: int):
    g = torch.Generator().manual_seed(rank)
    while True:
        start = torch.randint(0, VOCAB, (8, 1), generator=g)
        seq = (start + torch.arange(SEQ + 1)) % VOCAB
        yield seq[:, :-1], seq[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop", required=True)
    parser.add_argument("--nan-at", type=int, default=0, help="loop iteration of the NaN (0: none)")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--collector-url", default=None)
    parser.add_argument("--job", default="default")
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    agent = torchvitals.watch(
        model,
        opt,
        checkpoint_dir=args.ckpt,
        checkpoint_every=10,
        healthy_window=3,
        collector_url=args.collector_url,
        collector_job=args.job,
        collector_poll_seconds=0.2,
    )
    reports = []
    stop = Path(args.stop)
    data = iter(agent.batches(batches(rank)))  # timed: the data-wait panels have a signal
    for tick in range(1, args.max_steps + 1):
        x, y = next(data)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        if rank == 1 and tick == args.nan_at:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        report = agent.step(loss, samples=x.shape[0], tokens=x.numel(), scaler=scaler)
        opt.zero_grad(set_to_none=True)
        reports.append(
            {
                "tick": tick,
                "step": report.step,
                "action": report.action,
                "verdicts": [v.pattern for v in report.verdicts],
            }
        )
        # Every rank reads the stop file at the same tick, so no rank leaves a collective alone.
        flag = torch.tensor([float(stop.exists())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
        time.sleep(args.step_sleep)
    agent.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"reports": reports}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
