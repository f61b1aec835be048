"""A model one of whose layers is left out of the forward pass while the optimizer holds it,
for tests/unit/test_missing_grads.py and tests/distributed/test_missing_grads_ddp.py.

    from support.bypass import Bypass, train, ddp_bypass
    model = Bypass("bypass")      # layers.0 is skipped: its parameters never get a gradient
    model = Bypass("zeroed")      # layers.0 runs, times 0: gradients present and exactly zero
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

import torchvitals

LAYER = 0
"""The layer left out (or zeroed)."""


class Bypass(nn.Module):
    """``inp`` -> four tanh layers -> ``out``; ``mode`` says what happens to ``layers.0``."""

    def __init__(self, mode: str = "none", width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for i, layer in enumerate(self.layers):
            if i != LAYER or self.mode == "none":
                h = torch.tanh(layer(h))
            elif self.mode == "zeroed":
                h = h + 0.0 * torch.tanh(layer(h))
        return self.out(h)


def batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(32, 8, generator=gen)
        out.append((x, torch.sin(x.sum(1, keepdim=True))))
    return out


class Lines(logging.Handler):
    """Collects torchvitals' warning lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train(model: nn.Module, inner: nn.Module, steps: int, seed: int, **config: Any) -> dict:
    """``steps`` steps of AdamW over every parameter of ``inner`` (``model`` may wrap it);
    returns each report's norms and verdicts, the reference norms from ``param.grad``, and the
    warning lines."""
    opt = torch.optim.AdamW(inner.parameters(), lr=1e-2)
    lines = Lines()
    logging.getLogger("torchvitals").addHandler(lines)
    out: dict[str, Any] = {"reports": [], "ref": []}
    try:
        with torchvitals.watch(model, opt, metrics_port=0, log_dir="", **config) as agent:
            out["blocks"] = agent.block_names
            for x, y in batches(steps, seed):
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                out["ref"].append(
                    {
                        name: None if p.grad is None else float(p.grad.double().pow(2).sum())
                        for name, p in inner.named_parameters()
                    }
                )
                report = agent.step(loss)
                out["reports"].append(
                    {
                        "grad_norm": dict(report.grad_norm),
                        "total": report.grad_norm_total,
                        "missing": list(report.grad_norm_missing),
                        "action": report.action,
                        "update_ratio": dict(report.update_ratio),
                        "verdicts": [
                            (v.pattern, v.block, v.evidence.get("fired")) for v in report.verdicts
                        ],
                    }
                )
            out["history"] = [
                (v.pattern, v.block, v.evidence.get("fired")) for v in agent.detector.history
            ]
    finally:
        logging.getLogger("torchvitals").removeHandler(lines)
    out["warnings"] = [ln for ln in lines.lines if "could read a gradient" in ln]
    return out


def ddp_bypass(rank: int, world: int, mode: str, steps: int) -> dict:
    """The model under DDP (unused parameters allowed), each rank its own data."""
    from torch.nn.parallel import DistributedDataParallel

    inner = Bypass(mode)
    model = DistributedDataParallel(inner, find_unused_parameters=True)
    return train(model, inner, steps, seed=rank, sample_every=5)


def block_norm(ref: dict[str, float | None], block: str) -> float:
    """The block's norm from the reference sums of squares (None: no gradient, counted 0)."""
    return math.sqrt(sum(v or 0.0 for n, v in ref.items() if n.startswith(block + ".")))
