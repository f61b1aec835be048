"""Rank functions for test_framework_skip.py: a DDP loop that skips ``optimizer.step()`` itself
when the reduced gradients are not finite (as DeepSpeed or a GradScaler does on an overflow),
with a NaN loss on rank 1 at one step, and one whose GradScaler skips it, clearing the gradients
through the model or the optimizer."""

from __future__ import annotations

import math

import torch
from torch.nn.parallel import DistributedDataParallel

import torchvitals

FAULT = 4


def _ddp_model() -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    )


def _recorded_loss(
    model: torch.nn.Module,
    agent: torchvitals.Agent,
    gen: torch.Generator,
    rank: int,
    step: int,
    fault: float,
    losses: list[float],
) -> torch.Tensor:
    """One batch's loss, its value appended to ``losses``, times ``fault`` on rank 1 at FAULT,
    recorded with the agent."""
    x = torch.randn(8, 4, generator=gen)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    losses.append(loss.item())
    if rank == 1 and step == FAULT:
        loss = loss * fault
    agent.record_loss(loss)
    return loss


def _summary(r: torchvitals.Report) -> dict:
    return {
        "step": r.step,
        "action": r.action,
        "loss": r.loss,
        "nonfinite_loss": r.nonfinite_loss,
        "grad_norm_total": r.grad_norm_total,
    }


def loop_that_skips_by_itself(rank: int, world: int, steps: int) -> dict:
    model = _ddp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    real = []
    opt.register_step_pre_hook(lambda *_: real.append(1))
    agent = torchvitals.watch(model, opt, log_dir="", metrics_port=0)
    gen = torch.Generator().manual_seed(rank)
    reports, losses, skipped_by_loop = [], [], []
    for step in range(1, steps + 1):
        loss = _recorded_loss(model, agent, gen, rank, step, float("nan"), losses)
        loss.backward()
        # The framework's own test, on the all-reduced gradients: every rank agrees.
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        before = agent.last_report
        if math.isfinite(norm):
            opt.step()
        else:
            skipped_by_loop.append(step)
        opt.zero_grad(set_to_none=True)
        assert agent.last_report is not before, f"step {step} went unreported"
        reports.append(_summary(agent.last_report))
    agent.close()
    return {
        "reports": reports,
        "losses": losses,
        "real": len(real),
        "skipped_by_loop": skipped_by_loop,
        "step_count": agent.step_count,
    }


CLEAR = {
    "model": lambda model, opt: model.zero_grad(),  # the DDP wrapper
    "inner": lambda model, opt: model.module.zero_grad(),  # the module inside it
    "optimizer": lambda model, opt: opt.zero_grad(),
}
"""The ways a loop or framework clears the gradients after a step."""


def loop_with_a_scaler(
    rank: int, world: int, steps: int, clears: list[list[str]], routed: bool
) -> dict:
    """A DDP loop stepping through a CPU GradScaler, rank 1's loss Inf at FAULT (the scaler skips
    the step on every rank: the all-reduced gradients are Inf everywhere), each rank clearing
    the gradients its own way (``clears[rank]``, in order). ``routed``: ``scaler.step(opt)`` as
    usual (the agent's route sees the overflow); else the scaler's ``step`` bound before
    ``watch()``, as a framework holding it since its setup does: the skip never reaches the agent
    and is seen only when the gradients are cleared."""
    model = _ddp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    bound_before_watch = scaler.step
    real: list[float] = []
    opt.register_step_pre_hook(
        lambda o, *_: real.append(
            math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        )
    )
    agent = torchvitals.watch(model, opt, log_dir="", metrics_port=0)
    gen = torch.Generator().manual_seed(rank)
    reports, losses = [], []
    for step in range(1, steps + 1):
        loss = _recorded_loss(model, agent, gen, rank, step, float("inf"), losses)
        scaler.scale(loss).backward()
        (scaler.step if routed else bound_before_watch)(opt)
        scaler.update()
        for clear in clears[rank]:
            CLEAR[clear](model, opt)
        reports.append(_summary(agent.last_report))
    count = agent.step_count
    agent.close()
    return {
        "reports": reports,
        "losses": losses,
        "real": real,
        "step_count": count,
        "patched_after_close": "zero_grad" in vars(opt)
        or hasattr(torch.nn.Module.zero_grad, "__wrapped__"),
    }
