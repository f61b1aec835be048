"""Rank functions for tests/scenarios/test_scenarios_more.py (spawned by support.world.run_world).

Each trains the tiny GPT under DDP (gloo, world size 2), injects one fault at a named rank and
step, and returns plain data: per step the verdicts and the fields the parent compares across
ranks.
"""

from __future__ import annotations

import math
import time

import torch
from support.models import TINY, TinyGPT, random_batches
from torch.nn.parallel import DistributedDataParallel as DDP

import torchvitals


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("nan")
    return grad


def _verdicts(report) -> list[tuple]:
    return [(v.pattern, v.block, v.step, v.evidence.get("rank")) for v in report.verdicts]


def nan_grad_on_one_rank(
    rank: int, world: int, steps: int, bad_rank: int, bad_step: int, param: str
) -> dict:
    """``bad_rank`` alone turns one element of ``param``'s gradient into NaN at ``bad_step``.

    The NaN enters through a tensor hook on the parameter, which runs before the gradient is
    accumulated and so before DDP's bucket all-reduce carries it to every rank.
    """
    torch.manual_seed(0)
    model = DDP(TinyGPT(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = dict(model.module.named_parameters())[param]
    steps_out = []
    with torchvitals.watch(model, opt) as agent:
        batches = random_batches(
            steps, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank
        )
        for step, (x, y) in enumerate(batches, start=1):
            hook = target.register_hook(_poison) if (rank, step) == (bad_rank, bad_step) else None
            loss = _loss(model, x, y)
            loss.backward()
            if hook is not None:
                hook.remove()
            before = [p.detach().clone() for p in model.parameters()]
            report = agent.step(loss)
            changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
            opt.zero_grad(set_to_none=True)
            steps_out.append(
                {
                    "step": report.step,
                    "verdicts": _verdicts(report),
                    "action": report.action,
                    "nonfinite_grad": report.nonfinite_grad,
                    "nonfinite_loss": report.nonfinite_loss,
                    "changed": changed,
                    "finite_blocks": sorted(
                        b for b, v in report.grad_norm.items() if math.isfinite(v)
                    ),
                }
            )
        history = [(v.pattern, v.block, v.step) for v in agent.detector.history]
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"steps": steps_out, "history": history, "checksum": checksum}


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def slow_rank(rank: int, world: int, steps: int, slow: int, from_step: int, delay_s: float) -> dict:
    """Rank ``slow`` sleeps ``delay_s`` in its data loading on every step from ``from_step`` on."""
    torch.manual_seed(0)
    model = DDP(TinyGPT(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = list(
        random_batches(steps, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank)
    )
    out = []
    with torchvitals.watch(model, opt) as agent:
        for step in range(1, steps + 1):
            if rank == slow and step >= from_step:
                time.sleep(delay_s)  # the data loader of this rank stalls
            x, y = batches[step - 1]
            loss = _loss(model, x, y)
            loss.backward()
            report = agent.step(loss)
            opt.zero_grad(set_to_none=True)
            out.append(
                {
                    "step": report.step,
                    "verdicts": _verdicts(report),
                    "compute": report.timing.compute_seconds,
                }
            )
        history = [
            (v.pattern, v.block, v.step, v.evidence.get("rank")) for v in agent.detector.history
        ]
    return {"steps": out, "history": history}
