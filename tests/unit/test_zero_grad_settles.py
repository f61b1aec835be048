"""A step a GradScaler skipped where the agent could not see it is settled by ``model.zero_grad()``
as well as by ``optimizer.zero_grad()``: reported as that step's own skip, exactly once, and the
next step reports its own loss and gradient norm. In-process, a second or two.

    python -m pytest tests/unit/test_zero_grad_settles.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import torchvitals

FAULT, STEPS = 3, 6


class Wrapper(nn.Module):
    """A wrapper the agent is not told about, holding the model as ``.module`` (DDP's shape)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def train(clear: str) -> dict:
    """A loop that steps through a GradScaler's ``step`` bound before ``watch()`` (so the
    scaler's overflow skip never reaches the agent), with an Inf loss at FAULT, clearing the
    gradients the way ``clear`` says."""
    model = mlp()
    outer = Wrapper(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaler_step = scaler.step  # taken before watch: torch's own, not the agent's route
    real: list[float] = []
    opt.register_step_pre_hook(
        lambda o, *_: real.append(
            math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        )
    )
    agent = torchvitals.watch(model, opt, log_dir="", metrics_port=0)
    reports, losses = [], []
    gen = torch.Generator().manual_seed(0)
    for step in range(1, STEPS + 1):
        x = torch.randn(8, 4, generator=gen)
        loss = ((outer(x) - x.sum(1, keepdim=True)) ** 2).mean()
        losses.append(loss.item())
        if step == FAULT:
            loss = loss * float("inf")
        agent.record_loss(loss)
        scaler.scale(loss).backward()
        scaler_step(opt)
        scaler.update()
        if clear in ("model", "both"):
            model.zero_grad()
        if clear in ("wrapper", "both"):
            outer.zero_grad()
        if clear == "optimizer":
            opt.zero_grad()
        r = agent.last_report
        reports.append((r.step, r.action, r.loss, r.grad_norm_total))
    count = agent.step_count
    agent.close()
    return {
        "reports": reports,
        "losses": losses,
        "real": real,
        "step_count": count,
        "zero_grad_patched": "zero_grad" in vars(opt)
        or nn.Module.zero_grad is not ORIGINAL_ZERO_GRAD,
    }


ORIGINAL_ZERO_GRAD = nn.Module.zero_grad


@pytest.mark.parametrize("clear", ["model", "wrapper", "optimizer", "both"])
def test_a_scaler_skip_is_settled_in_its_step_whichever_zero_grad_the_loop_calls(clear):
    run = train(clear)
    reports = run["reports"]
    assert [(r[0], r[1]) for r in reports] == [
        (s, "skip" if s == FAULT else "step") for s in range(1, STEPS + 1)
    ]
    assert not math.isfinite(reports[FAULT - 1][2])
    stepped = [r for r in reports if r[1] == "step"]
    assert len(run["real"]) == STEPS - 1 and run["step_count"] == STEPS, "one settlement per skip"
    for (step, _, loss, norm), real_norm in zip(stepped, run["real"]):
        assert loss == pytest.approx(run["losses"][step - 1], rel=1e-6), step
        assert norm == pytest.approx(real_norm, rel=1e-5), step  # the unscaled gradients
    assert not run["zero_grad_patched"], "close() leaves no zero_grad patch"
