"""What the framework jobs record about each step, from the optimizer itself and the report."""

from __future__ import annotations

import math
from typing import Any

import torch


def record_real_steps(optimizer: torch.optim.Optimizer, into: list[dict[str, float]]) -> None:
    """Append the learning rate and the gradient norm of every real step of ``optimizer``: its
    own pre-step hook runs inside the real step only, after the framework clipped."""
    def real_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum())
                             for g in opt.param_groups for p in g["params"] if p.grad is not None))
        into.append({"lr": opt.param_groups[0]["lr"], "grad_norm": norm})
    optimizer.register_step_pre_hook(real_step)


def describe(report: Any) -> dict[str, Any]:
    """The report's fields the tests assert on, as JSON."""
    return {"step": report.step, "action": report.action, "loss": report.loss, "lr": report.lr,
            "grad_norm_total": report.grad_norm_total, "rollback": report.rollback,
            "verdicts": [v.pattern for v in report.verdicts]}
