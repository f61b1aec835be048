"""A two-rank DDP job that obeys the collector (see test_directives_job.py)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from support.models import TINY, TinyGPT, random_batches
from support.world import wrap

import torchvitals


def obedient_job(rank: int, world: int, url: str, root: str, marker: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = wrap("ddp", TinyGPT(**TINY), world)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    agent = torchvitals.watch(
        model,
        opt,
        checkpoint_dir=root,
        checkpoint_every=10,
        healthy_window=3,
        collector_url=url,
        collector_job="train-a",
        collector_poll_seconds=0.05,
    )
    data = list(
        random_batches(400, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank)
    )
    out = []
    for x, y in agent.batches(data):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )
        loss.backward()
        report = agent.step(loss)
        opt.zero_grad(set_to_none=True)
        out.append(
            {
                "step": report.step,
                "action": report.action,
                "rollback": report.rollback.to_dict() if report.rollback else None,
                "verdicts": [v.pattern for v in report.verdicts],
                "time": time.time(),
            }
        )
        if rank == 0 and report.step == 25 and not Path(marker).exists():
            Path(marker).write_text(str(time.time()))
        time.sleep(0.02)  # a step of a real job takes a while; polls land in between
        if len(out) >= steps:
            break
    agent.close()
    return {"reports": out}
