"""A small GPT and synthetic token batches for examples, tests and benchmarks.

    python examples/quickstart.py      # trains it under torchvitals

The model lives in the package (``torchvitals.agent.tools.demo.model``) because ``torchvitals demo`` trains
it after a plain install; the name stays importable from here for the examples and tests.
"""

from __future__ import annotations

import torch

from torchvitals.agent.tools.demo.model import Attention, Block, TinyGPT

__all__ = ["Attention", "Block", "TinyGPT", "random_batches"]


def random_batches(n: int, batch: int, seq_len: int, vocab: int, seed: int = 0):
    """Deterministic token batches (inputs, next-token targets) with learnable structure."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        step = torch.randint(1, 4, (batch, 1), generator=g)
        seq = (start + step * torch.arange(seq_len + 1)) % vocab
        noise = torch.rand(seq.shape, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)
        yield seq[:, :-1], seq[:, 1:]
