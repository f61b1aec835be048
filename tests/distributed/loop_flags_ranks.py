"""Rank functions for test_loop_flags.py: one rank's loop skips a step by itself, or steps twice
on the same gradients, while the other rank steps as usual."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torchvitals

FAULT = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _loss(model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(8, 4, generator=gen)
    return ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()


def one_rank_skips(rank: int, world: int, steps: int) -> dict:
    """DDP; at FAULT rank 1's loop alone finds its loss suspect and clears the gradients without
    ``optimizer.step()``; rank 0 steps."""
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    real: list[int] = []
    opt.register_step_pre_hook(lambda *_: real.append(1))
    agent = torchvitals.watch(model, opt, log_dir="", metrics_port=0)
    gen = torch.Generator().manual_seed(rank)
    reports = []
    try:
        for step in range(1, steps + 1):
            loss = _loss(model, gen)
            agent.record_loss(loss)
            loss.backward()
            if not (rank == 1 and step == FAULT):
                opt.step()
            opt.zero_grad(set_to_none=True)
            r = agent.last_report
            reports.append((r.step, str(r.action), r.loop_skip_count, r.loop_skip_ranks))
    finally:
        agent.close()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    return {"reports": reports, "real": len(real), "weights": weights}


def one_rank_steps_twice(rank: int, world: int) -> dict:
    """Plain models (no gradient collective in backward); at FAULT rank 1 steps again without a
    backward pass since its last step, on the gradients it kept; rank 0 steps as usual."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = torchvitals.watch(model, opt, log_dir="", metrics_port=0)
    gen = torch.Generator().manual_seed(rank)
    error = ""
    try:
        for step in range(1, FAULT + 1):
            if not (rank == 1 and step == FAULT):
                _loss(model, gen).backward()
            before = [p.detach().clone() for p in model.parameters()]
            try:
                opt.step()
            except torchvitals.DoubleStepError as e:
                error = str(e)
                unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
                break
            if not (rank == 1 and step == FAULT - 1):  # rank 1 keeps its gradients
                opt.zero_grad(set_to_none=True)
    finally:
        agent.close()
    dist.barrier()  # both ranks are here: neither was left in a collective
    return {"error": error, "step": step, "unchanged": unchanged if error else None}
