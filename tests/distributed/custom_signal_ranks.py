"""What each rank runs for test_custom_signal.py: the example's parameter-norm signal on two gloo
ranks, as a sharded sum, as DDP replicas, and given to one rank only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import torchvitals
from torchvitals.agent.tools.demo.data import random_batches
from torchvitals.agent.tools.demo.model import TinyGPT
from torchvitals.agent.tools.examples.custom_vitals import PARAM_NORM, ParamNorm

QUIET = {"log_dir": "", "metrics_port": 0}


def _model(seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab=32, d_model=32, n_layers=1, seq_len=16)


def _squares(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return sum(float(p.double().pow(2).sum()) for p in model.parameters())


def _run(rank: int, model: torch.nn.Module, steps: int, signals: list) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = torchvitals.watch(model, optimizer, signals=signals, **QUIET)
    mine, reported = [], []
    try:
        for x, y in random_batches(steps, batch=4, seq_len=16, vocab=32, seed=rank):
            logits = model(x)  # through DDP's forward: its backward syncs the gradients
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            mine.append(_squares(model))
            report = agent.step(loss)
            reported.append(report.custom.get(PARAM_NORM))
            optimizer.zero_grad(set_to_none=True)
    finally:
        agent.close()
    return {"mine": mine, "reported": reported, "collectives": agent._reducer.collectives}


def sharded(rank: int, world: int, steps: int) -> dict:
    """Each rank holds different weights (its part of the whole): the norm of all of them."""
    model = _model(seed=rank)
    return _run(rank, model, steps, [ParamNorm(model, replicated=False)])


def replicated(rank: int, world: int, steps: int) -> dict:
    """DDP replicas, measured with and without the signal (the collectives it costs)."""
    without = _run(rank, DistributedDataParallel(_model(seed=0)), steps, [])
    model = DistributedDataParallel(_model(seed=0))
    return {"without": without, "with": _run(rank, model, steps, [ParamNorm(model)])}


def mismatched(rank: int, world: int) -> tuple[str, str]:
    """Rank 0 alone passes the signal: watch() must raise on every rank, not hang or abort."""
    model = _model(seed=0)
    signals = [ParamNorm(model)] if rank == 0 else []
    try:
        torchvitals.watch(
            model, torch.optim.SGD(model.parameters(), lr=0.1), signals=signals, **QUIET
        )
    except torchvitals.TorchvitalsError as error:
        return type(error).__name__, str(error)
    return "", "watch() returned"
