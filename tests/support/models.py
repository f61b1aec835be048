"""The small GPT the tests train, its test size, and synthetic token batches.

    from support.models import TINY, TINY_BLOCKS, TinyGPT, random_batches

The model and the batches ship with the package (the demo trains them after a plain install);
the tests and the examples import them from there, never from ``examples/``.
"""

from __future__ import annotations

from torchvitals.agent.tools.demo.data import random_batches
from torchvitals.agent.tools.demo.model import TinyGPT

__all__ = ["TINY", "TINY_BLOCKS", "TinyGPT", "random_batches"]

TINY = dict(vocab=64, d_model=32, n_layers=3, n_heads=4, seq_len=16)
"""A 3-block GPT small enough for a step in milliseconds on one CPU thread."""
TINY_BLOCKS = ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "blocks.2", "lm_head", "other"]
"""The blocks the agent finds in ``TinyGPT(**TINY)``, in order."""
