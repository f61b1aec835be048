"""Healthy runs of a few model families raise no warning at all (false alarms are bugs).

Each family trains a few dozen steps with a sensible optimizer under the default thresholds.
The LSTM language model and the llama-shaped stack used to raise ``vanishing_gradients``: the
rule compared the embedding with the head (sparse embedding gradients, the loss's own gradient
at the head), which are not the first and last layers of a deep stack.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from support.llamalike import LlamaLike
from support.models import TinyGPT, random_batches
from torch import nn

import torchvitals
from torchvitals.agent.detect import CRITICAL, WARNING

VOCAB, SEQ, BATCH, STEPS = 64, 16, 8, 60


@pytest.fixture(autouse=True)
def default_config(monkeypatch):
    for key in list(os.environ):
        if key.startswith("TORCHVITALS_") and key not in (
            "TORCHVITALS_METRICS_PORT",
            "TORCHVITALS_LOG_DIR",
        ):
            monkeypatch.delenv(key)


class LstmLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 32):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)

    def loss(self, x, y):
        h, _ = self.lstm(self.embedding(x))
        return F.cross_entropy(self.decoder(h).flatten(0, 1), y.flatten())


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 64),
            nn.ReLU(),
            nn.Linear(64, 64),
            nn.ReLU(),
            nn.Linear(64, 64),
            nn.ReLU(),
            nn.Linear(64, 4),
        )
        self.teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))

    def loss(self, x, y):
        feats = F.one_hot(x[:, :16], VOCAB).float().mean(-1) * VOCAB - 1.0
        return F.cross_entropy(self.net(feats), (feats @ self.teacher).argmax(1))


FAMILIES = {
    "lstm": (LstmLM, lambda p: torch.optim.Adam(p, lr=3e-3)),
    "gpt": (
        lambda: TinyGPT(vocab=VOCAB, d_model=32, n_layers=2, n_heads=4, seq_len=SEQ),
        lambda p: torch.optim.AdamW(p, lr=3e-3),
    ),
    "llama_dict": (
        lambda: LlamaLike(vocab=VOCAB, dim=32, n_layers=4),
        lambda p: torch.optim.AdamW(p, lr=3e-3),
    ),
    "mlp": (Mlp, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
}


def train(family: str, sample_every: int):
    torch.manual_seed(0)
    build, make_opt = FAMILIES[family]
    model = build()
    optimizer = make_opt(model.parameters())
    agent = torchvitals.watch(model, optimizer, sample_every=sample_every)
    losses = []
    try:
        for x, y in random_batches(STEPS, BATCH, SEQ, VOCAB, seed=0):
            loss = model.loss(x, y)
            loss.backward()
            losses.append(agent.step(loss).loss)
            optimizer.zero_grad(set_to_none=True)
    finally:
        agent.close()
    return agent, losses


@pytest.mark.parametrize("sample_every", [1, 10])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_healthy_run_raises_no_warning(family, sample_every):
    agent, losses = train(family, sample_every)
    loud = [str(v) for v in agent.detector.history if v.severity in (WARNING, CRITICAL)]
    assert loud == []
    assert sum(losses[-10:]) / 10 < losses[0], (
        f"{family} did not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
