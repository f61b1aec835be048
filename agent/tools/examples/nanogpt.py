"""The nanoGPT-shaped loop examples/nanogpt_loop.py runs, torchvitals' two lines in it.

    python examples/nanogpt_loop.py --out runs/nanogpt
    from torchvitals.agent.tools.examples.nanogpt import Settings, train
    summary = train(Settings(out="runs/nanogpt", max_iters=60))

The loop is the one nanoGPT's train.py runs: it sets the learning rate by hand every iteration
(warmup, then cosine), accumulates gradients over micro-batches, scales them with a GradScaler,
unscales and clips them itself, and draws its batches at random with ``torch.randint``.
torchvitals adds ``watch`` and ``record_loss`` (marked ``# torchvitals``). The tests run this
loop with ``train(corrupt=..., seen=...)``: a batch of bad data recognised by its content, and
every batch drawn.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import torchvitals

from ...report import Report
from ..demo.model import TinyGPT


@dataclass
class Settings:
    """The loop's settings, under nanoGPT's names where it has them."""

    out: str = "torchvitals_runs/nanogpt"
    max_iters: int = 120
    batch_size: int = 8
    block_size: int = 32
    grad_accum: int = 2
    learning_rate: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 10
    grad_clip: float = 1.0
    dtype: str = "float32"  # "float16" turns the GradScaler on (CUDA or CPU autocast)
    checkpoint_every: int = 10
    seed: int = 1337


@dataclass(frozen=True)
class Summary:
    """What one run of the loop did, from its reports."""

    iterations: int
    """Loop iterations run (each one ``scaler.step``)."""
    steps: int
    """The model's step at the end: iterations less those a rollback undid."""
    lr_scale: float
    """The back-off the rollbacks left on the learning rate (1.0 with none)."""
    first_loss: float
    final_loss: float
    rollbacks: list[Any]
    """``report.rollback`` of each step that rolled back, in order."""
    reports: list[Report]
    """``agent.last_report`` after every iteration."""


def get_lr(it: int, s: Settings) -> float:
    """nanoGPT's schedule: linear warmup, then cosine down to min_lr."""
    if it < s.warmup_iters:
        return s.learning_rate * (it + 1) / (s.warmup_iters + 1)
    ratio = min(1.0, (it - s.warmup_iters) / max(1, s.max_iters - s.warmup_iters))
    return s.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (s.learning_rate - s.min_lr)


def corpus(vocab: int = 64, n: int = 20_000) -> torch.Tensor:
    """A token stream with structure to learn (arithmetic runs with some noise)."""
    g = torch.Generator().manual_seed(0)
    step = torch.randint(1, 4, (n // 50 + 1, 1), generator=g)
    start = torch.randint(0, vocab, (n // 50 + 1, 1), generator=g)
    runs = (start + step * torch.arange(50)) % vocab
    data = runs.reshape(-1)[:n]
    noise = torch.rand(n, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, vocab, (n,), generator=g), data)


def train(
    s: Settings,
    corrupt: Callable[[torch.Tensor], bool] | None = None,
    seen: list[torch.Tensor] | None = None,
) -> Summary:
    """Run the loop, on one process or under torchrun (gloo).

    Args:
        s: the settings.
        corrupt: says whether a drawn batch is bad data: its loss becomes NaN, as a corrupt
            shard would make it.
        seen: collects a copy of every batch drawn.

    Returns:
        What the run did.
    """
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if ddp else 0
    torch.manual_seed(s.seed + rank)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = corpus().to(device)
    model: torch.nn.Module = TinyGPT(vocab=64, d_model=64, n_layers=2, seq_len=s.block_size)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.learning_rate, weight_decay=0.1)
    scaler = torch.amp.GradScaler(device, enabled=(s.dtype == "float16"))
    ctx = torch.autocast(device, dtype=torch.float16) if s.dtype == "float16" else nullcontext()
    if ddp:
        model = DistributedDataParallel(model)
    agent = torchvitals.watch(
        model,
        optimizer,
        checkpoint_dir=os.path.join(s.out, "ckpt"),  # torchvitals
        checkpoint_every=s.checkpoint_every,
        log_dir=s.out,
        run_name="events",
        resume="auto",
        metrics_port=0,
    )

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - s.block_size, (s.batch_size,), device=device)
        x = torch.stack([data[i : i + s.block_size] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + s.block_size] for i in ix])
        if seen is not None:
            seen.append(x.clone())
        return x, y

    iter_num = 0
    reports: list[Report] = []
    while iter_num < s.max_iters:
        lr = get_lr(iter_num, s)
        for group in optimizer.param_groups:  # the loop owns the LR, as nanoGPT does
            group["lr"] = lr
        for micro_step in range(s.grad_accum):
            if isinstance(model, DistributedDataParallel):  # sync on the last micro-step only
                model.require_backward_grad_sync = micro_step == s.grad_accum - 1
            x, y = get_batch()
            with ctx:
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            if corrupt is not None and corrupt(x):
                loss = loss * float("nan")
            agent.record_loss(loss)  # torchvitals
            loss = loss / s.grad_accum
            scaler.scale(loss).backward()
        if s.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        scaler.step(optimizer)  # goes through the agent, overflow steps too
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        assert agent.last_report is not None  # every iteration stepped through the agent
        reports.append(agent.last_report)
    agent.close()
    summary = Summary(
        iterations=iter_num,
        steps=agent.step_count,
        lr_scale=agent.lr_scale,
        first_loss=reports[0].loss,
        final_loss=reports[-1].loss,
        rollbacks=[r.rollback for r in reports if r.rollback is not None],
        reports=reports,
    )
    if ddp:
        dist.destroy_process_group()
    return summary
