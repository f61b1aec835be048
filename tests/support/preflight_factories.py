"""Setups for ``torchvitals preflight support.preflight_factories:<name>`` in the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, detached: bool = False):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
        )
        self.detached = detached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        # The broken wiring under test: a tensor rebuilt outside the graph.
        return out.detach().requires_grad_() if self.detached else out


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def evaluate(model: nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        loss = loss_fn(model, data(32, 99))
    model.train()
    return float(loss)


def setup(detached: bool = False) -> dict:
    torch.manual_seed(0)
    return {
        "model": MLP(detached),
        "loss_fn": loss_fn,
        "batch": data(12, 0),
        "batches": [data(32, s) for s in range(1, 5)],
        "evaluate": evaluate,
        "optimizer": lambda params: torch.optim.Adam(params, lr=3e-3),
    }


def healthy() -> dict:
    return setup()


def detached() -> dict:
    return setup(detached=True)


def incomplete() -> dict:
    return {"model": MLP(), "batch": data(12, 0)}
