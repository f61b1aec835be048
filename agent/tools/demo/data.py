"""The demo's data: the bundled text as characters, cut into seeded per-rank batches.

    text = load_text(); vocab = Vocab(text); batches = text_batches(text, vocab, 40, 16, 64, rank)

``random_batches`` makes synthetic token batches instead, for the examples, tests and
benchmarks that train the same small GPT without the text.

The text (``sonnets.txt``, Shakespeare's sonnets of 1609, public domain) ships as package data,
so the demo needs no download. Batches are a list, the same on every pass: ``agent.batches``
counts their global positions, so a rollback can skip exactly the ones that broke the run.
"""

from __future__ import annotations

from importlib import resources

import torch

TEXT = "sonnets.txt"


def load_text() -> str:
    """The bundled text (read from the installed package, editable or not)."""
    return resources.files(__package__).joinpath(TEXT).read_text(encoding="utf-8")


class Vocab:
    """Character-level tokens: every distinct character of the text, sorted."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._index[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def text_batches(
    text: str, vocab: Vocab, n: int, batch: int, seq_len: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of random windows of the text: (inputs, next-character targets).

    Args:
        text: the corpus.
        vocab: its characters.
        n: batches per pass.
        batch: windows per batch.
        seq_len: characters per window.
        seed: the windows' generator seed (give each rank its own, as a sampler would).
    """
    ids = vocab.encode(text)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, len(ids) - seq_len - 1, (batch, 1), generator=g)
        window = ids[start + torch.arange(seq_len + 1)]
        out.append((window[:, :-1], window[:, 1:]))
    return out


def random_batches(n: int, batch: int, seq_len: int, vocab: int, seed: int = 0):
    """Deterministic token batches with learnable structure: strided runs, 10% noise.

    Args:
        n: batches to yield.
        batch: sequences per batch.
        seq_len: tokens per sequence.
        vocab: token ids are below it.
        seed: the generator's seed (the same seed yields the same batches).

    Returns:
        A generator of ``(inputs, next-token targets)``, each ``(batch, seq_len)`` long tensors.
    """
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        step = torch.randint(1, 4, (batch, 1), generator=g)
        seq = (start + step * torch.arange(seq_len + 1)) % vocab
        noise = torch.rand(seq.shape, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)
        yield seq[:, :-1], seq[:, 1:]
