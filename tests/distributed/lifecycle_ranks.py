"""``watch()``/``close()`` cycles in one process, run on every rank of a spawned gloo world.

Each cycle is what a sweep or a second ``Trainer.train()`` does: a new DDP model and optimizer,
``watch(..., checkpoint_dir=..., resume="auto")`` over the same folder, a few steps with
background checkpoints (the last one still being written at ``close()``), then ``close()``.
"""

from __future__ import annotations

import faulthandler
import sys
from typing import Any

import torch
from support.models import TINY, TinyGPT, random_batches
from torch.nn.parallel import DistributedDataParallel

import torchvitals


def cycles(rank: int, world: int, root: str, n: int, steps: int) -> list[dict[str, Any]]:
    """``n`` cycles of ``steps`` steps each; per cycle what the agent resumed from, its
    checkpoint group's name and the steps' actions and checkpoints."""
    faulthandler.dump_traceback_later(90, exit=True, file=sys.stderr)  # a hang shows its stack
    data = list(
        random_batches(steps, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank)
    )
    out = []
    for _ in range(n):
        torch.manual_seed(0)
        model = DistributedDataParallel(TinyGPT(**TINY))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        agent = torchvitals.watch(
            model,
            opt,
            checkpoint_dir=root,
            resume="auto",
            checkpoint_every=2,
            healthy_window=0,
            metrics_port=0,
            log_dir="",
        )
        group = agent.watchdog.store._group
        reports = []
        for x, y in data:
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            )
            loss.backward()
            reports.append(agent.step(loss))
            opt.zero_grad(set_to_none=True)
        agent.close()
        out.append(
            {
                "resumed_from": agent.resumed_from,
                "group": group.group_name,
                "actions": [r.action for r in reports],
                "checkpointed": [r.step for r in reports if r.checkpoint.saved],
                "last_healthy": agent.watchdog.last_healthy,
            }
        )
    faulthandler.cancel_dump_traceback_later()
    return out
