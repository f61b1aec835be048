"""The small regression task the Accelerate and DeepSpeed examples train, shared with the tests.

    from torchvitals.agent.tools.demo.regression import mlp, micro_batches
    model = mlp()                      # the same initial weights on every rank (seed 0)
    batches = micro_batches(40, seed=rank)

A 3-layer tanh MLP fitting ``sin(sum(x))`` from 8 inputs: small enough for CPU ranks, smooth
enough that a healthy run raises no verdict, so an injected fault is the only one.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

BLOCKS = ["inp", "hid", "out"]
"""The blocks the agent finds in ``mlp(named=True)``."""


def mlp(named: bool = False) -> torch.nn.Sequential:
    """The model, built from seed 0 (the same weights on every rank); ``named``: its layers
    named ``inp``, ``hid``, ``out`` instead of numbered."""
    torch.manual_seed(0)
    layers = OrderedDict(
        inp=torch.nn.Linear(8, 32),
        act=torch.nn.Tanh(),
        hid=torch.nn.Linear(32, 32),
        act2=torch.nn.Tanh(),
        out=torch.nn.Linear(32, 1),
    )
    return torch.nn.Sequential(layers) if named else torch.nn.Sequential(*layers.values())


def micro_batch(gen: torch.Generator, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch drawn from ``gen``."""
    x = torch.randn(size, 8, generator=gen)
    return x, torch.sin(x.sum(1, keepdim=True))


def micro_batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` micro-batches (each rank its own seed)."""
    gen = torch.Generator().manual_seed(seed)
    return [micro_batch(gen) for _ in range(n)]


def deepspeed_config(stage: int, accumulate: int, clip: float) -> dict:
    """A DeepSpeed engine configuration for this task: 16 samples per micro-batch per rank."""
    return {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": accumulate,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
    }
