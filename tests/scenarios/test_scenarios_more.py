"""Failure scenarios on real small models, with the default thresholds.

    python -m pytest tests/scenarios/test_scenarios_more.py -q --durations=0

Each test trains a small model on CPU into one fingerprint of DESIGN.md "Failure patterns" and
asserts the verdict the agent names (pattern, block, step), plus a healthy control where the
same model without the fault must stay quiet. The distributed ones are in
test_scenarios_distributed.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from support.models import TINY, TinyGPT, random_batches
from torch import nn

import torchvitals

# ---------------------------------------------------------------- models, data, the loop


def mlp(d_in: int = 16, hidden: int = 32, depth: int = 4, d_out: int = 1) -> nn.Sequential:
    """Linear/ReLU pairs then a Linear head: blocks "0", "2", ... (ReLU joins its Linear)."""
    dims = [d_in] + [hidden] * (depth - 1)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(dims):
        layers += [nn.Linear(a, b), nn.ReLU()]
    layers.append(nn.Linear(hidden, d_out))
    return nn.Sequential(*layers)


def regression(n: int, d: int = 16, noise: float = 0.1, seed: int = 0):
    """y = sin(x . w) + noise, x ~ N(0, I): learnable, and with noise to overfit on."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, 1, generator=g) / math.sqrt(d)
    x = torch.randn(n, d, generator=g)
    return x, torch.sin(3 * x @ w) + noise * torch.randn(n, 1, generator=g)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def tiny_gpt_batches(steps: int):
    return list(random_batches(steps, batch=8, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))


def train(agent, opt, batches, loss_fn, *, scaler=None, on_step=None):
    """Train over ``batches``; return the reports (``on_step(report)`` runs after each step)."""
    reports = []
    for batch in batches:
        loss = loss_fn(batch)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        report = agent.step(loss, scaler=scaler)
        opt.zero_grad(set_to_none=True)
        reports.append(report)
        if on_step is not None:
            on_step(report)
    return reports


def fired(agent, pattern: str | None = None) -> list[tuple[str, str | None, int]]:
    return [
        (v.pattern, v.block, v.step)
        for v in agent.detector.history
        if pattern is None or v.pattern == pattern
    ]


# ---------------------------------------------------------------- dead or frozen layer


def _frozen_gpt(how: str):
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    frozen = list(model.blocks[1].parameters())
    live = [p for n, p in model.named_parameters() if not n.startswith("blocks.1.")]
    if how == "requires_grad_false":
        for p in frozen:
            p.requires_grad_(False)
        opt = torch.optim.AdamW(live, lr=1e-3)
    elif how == "not_in_optimizer":
        opt = torch.optim.AdamW(live, lr=1e-3)
    elif how == "lr_zero":  # wired correctly; only the measured update ratio can tell
        opt = torch.optim.AdamW([{"params": live}, {"params": frozen, "lr": 0.0}], lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


@pytest.mark.parametrize("how", ["requires_grad_false", "not_in_optimizer", "lr_zero"])
def test_frozen_block_is_a_dead_layer(how):
    model, opt = _frozen_gpt(how)
    active = []
    with torchvitals.watch(model, opt) as agent:
        reports = train(
            agent,
            opt,
            tiny_gpt_batches(30),
            lambda b: lm_loss(model, *b),
            on_step=lambda r: active.append(agent.detector.is_active("dead_layer", "blocks.1")),
        )
        history = fired(agent)
        verdicts = [v for v in agent.detector.history if v.pattern == "dead_layer"]
    # The measurement itself: blocks.1 never moves while every other block does.
    sampled = [r.update_ratio for r in reports if r.update_ratio]
    assert len(sampled) == 3
    for ratios in sampled:
        assert ratios["blocks.1"] == 0.0
        assert min(v for b, v in ratios.items() if b != "blocks.1") > 1e-4
    assert {v.block for v in verdicts} == {"blocks.1"}, history
    if how == "lr_zero":
        # dead_samples=2 samples of a zero ratio: the updates of steps 9 and 19, known at 20.
        assert [(v.step, v.evidence["fired"]) for v in verdicts] == [(20, "dead_ratio")]
        assert active == [False] * 19 + [True] * 11
    else:
        first = verdicts[0]
        assert (first.step, first.evidence["fired"]) == (1, "wiring")
        key = "requires_grad_false" if how == "requires_grad_false" else "not_in_optimizer"
        assert "blocks.1.attn.qkv.weight" in first.evidence[key]
        # The block is frozen from the first step to the last, so the warning stays active and
        # is emitted once. (Fails until the detector keeps wiring verdicts active: today the
        # UpdateRatios rule drops the key at step 10, when it has seen one zero sample of the
        # two it needs, and re-emits it at step 20.)
        assert active == [True] * 30, [s for s, a in enumerate(active, 1) if not a]
        assert [v.step for v in verdicts] == [1], history
    assert {p for p, _, _ in history} == {"dead_layer"}, history


def test_healthy_tiny_gpt_raises_nothing():
    """The control for the frozen and detached scenarios: the same model and data, no fault."""
    model, opt = _frozen_gpt("none")
    with torchvitals.watch(model, opt) as agent:
        reports = train(agent, opt, tiny_gpt_batches(30), lambda b: lm_loss(model, *b))
        assert fired(agent) == []
    assert reports[-1].loss < reports[0].loss


# ---------------------------------------------------------------- dead pipeline


def test_detached_output_is_a_dead_pipeline():
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]

    def detached_loss(batch):
        x, y = batch
        # The bug: the logits leave the graph, and requires_grad_ silences the autograd error.
        logits = model(x).detach().requires_grad_()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    with torchvitals.watch(model, opt) as agent:
        reports = train(agent, opt, tiny_gpt_batches(10), detached_loss)
        verdicts = [v for v in agent.detector.history if v.pattern == "dead_pipeline"]
        history = fired(agent)
    assert all(r.grad_norm_total == 0.0 and r.action == "step" for r in reports)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "nothing trains"
    # Exactly-zero gradients need 3 steps (not dead_pipeline_steps) to be called.
    assert [(v.step, v.block) for v in verdicts] == [(3, None)]
    assert verdicts[0].evidence["detached"] is True and verdicts[0].evidence["max_grad_norm"] == 0.0
    assert history == [("dead_pipeline", None, 3)]


# ---------------------------------------------------------------- dead ReLU


@pytest.mark.parametrize("bias", [-10.0, 0.0])
def test_large_negative_bias_kills_the_relus_of_that_block(bias):
    torch.manual_seed(0)
    model = mlp()
    with torch.no_grad():
        model[2].bias.fill_(bias)  # block "2": Linear(32, 32) + its ReLU
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = regression(512)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 512, 32)] * 2
    with torchvitals.watch(model, opt) as agent:
        assert agent.block_names == ["0", "2", "4", "6"]
        reports = train(agent, opt, batches, lambda b: F.mse_loss(model(b[0]), b[1]))
        dead = [(v.block, v.step) for v in agent.detector.history if v.pattern == "dead_relu"]
        history = fired(agent)
    zero = [r.activations["2"]["zero_fraction"] for r in reports if r.activations]
    if bias == 0.0:
        assert dead == [] and max(zero) < 0.9, (history, zero)
        return
    assert zero == [1.0] * len(zero)
    assert dead == [("2", 1)], history
    assert history[0] == ("dead_relu", "2", 1), "the dead block is named first"
    # Everything below the dead block gets exactly zero gradient, which Vanishing also sees
    # (last/first = inf) two steps later; it is a consequence, named after the cause.
    assert {p for p, _, _ in history} <= {"dead_relu", "vanishing_gradients"}, history


# ---------------------------------------------------------------- attention saturation


class AttnBlock(nn.Module):
    """Pre-norm block; attention is nn.MultiheadAttention or a custom one that records its
    logits with torchvitals.record_attention. ``logit_scale`` multiplies q.k."""

    def __init__(self, d: int, heads: int, custom: bool):
        super().__init__()
        self.custom, self.heads, self.logit_scale = custom, heads, 1.0
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        if custom:
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        else:
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        if self.custom:
            b, t, d = h.shape
            q, k, v = (
                z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                for z in self.qkv(h).split(d, 2)
            )
            scores = (q @ k.transpose(-2, -1)) * (self.logit_scale / math.sqrt(d // self.heads))
            scores = scores.masked_fill(mask, float("-inf"))
            torchvitals.record_attention(self, logits=scores)
            a = self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
        else:
            a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=True, average_attn_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class AttnLM(nn.Module):
    def __init__(
        self,
        custom: bool,
        vocab: int = 64,
        d: int = 32,
        heads: int = 4,
        layers: int = 3,
        seq_len: int = 16,
    ):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(AttnBlock(d, heads, custom) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.emb(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))

    def scale_logits(self, block: int, factor: float) -> None:
        """Multiply block ``block``'s q.k by ``factor`` (q and k weights by its square root)."""
        target = self.blocks[block]
        if target.custom:
            target.logit_scale = factor
            return
        d = target.attn.embed_dim
        with torch.no_grad():
            target.attn.in_proj_weight[: 2 * d] *= math.sqrt(factor)
            target.attn.in_proj_bias[: 2 * d] *= math.sqrt(factor)


@pytest.mark.parametrize("kind", ["mha", "custom"])
@pytest.mark.parametrize("factor", [100.0, 1.0])
def test_scaled_attention_logits_saturate_that_block(kind, factor):
    torch.manual_seed(0)
    model = AttnLM(custom=kind == "custom")
    model.scale_logits(1, factor)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torchvitals.watch(model, opt) as agent:
        reports = train(agent, opt, tiny_gpt_batches(30), lambda b: lm_loss(model, *b))
        verdicts = [v for v in agent.detector.history if v.pattern == "attention_saturation"]
        history = fired(agent)
    entropy = {
        b: [r.activations[b]["attention_entropy"] for r in reports if r.activations]
        for b in ("blocks.0", "blocks.1", "blocks.2")
    }
    assert all(len(v) == 4 for v in entropy.values()), "steps 1, 10, 20, 30 measure attention"
    healthy = ("blocks.0", "blocks.2") if factor != 1.0 else tuple(entropy)
    # Uniform causal rows would average ln(16!)/16 = 1.92 nats; healthy heads measure ~1.8.
    assert min(min(entropy[b]) for b in healthy) > 1.5, entropy
    if factor == 1.0:
        assert history == []
        return
    assert max(entropy["blocks.1"]) <= 0.1, entropy
    # A warning, emitted when it becomes active (step 1) and kept while the entropy stays low.
    assert [(v.block, v.step) for v in verdicts] == [("blocks.1", 1)], history
    assert verdicts[0].evidence["fired"] == "attention_entropy"
    assert agent.detector.is_active("attention_saturation", "blocks.1")
    assert history == [("attention_saturation", "blocks.1", 1)]


# ---------------------------------------------------------------- generalization gap


def _overfit(n_train: int, steps: int, seed: int, every: int = 10):
    """Full-batch training of a wide MLP on ``n_train`` noisy samples; validates every ``every``."""
    x, y = regression(512 + n_train, d=8, noise=0.5, seed=seed)
    (xv, xt), (yv, yt) = x.split([512, n_train]), y.split([512, n_train])
    torch.manual_seed(seed)
    model = mlp(d_in=8, hidden=64, depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    validation = []

    def validate(report):
        if report.step % every == 0:
            model.eval()
            with torch.no_grad():
                loss = F.mse_loss(model(xv), yv)
            model.train()
            validation.append((report.step, agent.observe_validation(loss)))

    with torchvitals.watch(model, opt) as agent:
        reports = train(
            agent,
            opt,
            [(xt, yt)] * steps,
            lambda b: F.mse_loss(model(b[0]), b[1]),
            on_step=validate,
        )
    return agent, reports, validation


def test_validation_rising_while_training_falls_is_a_generalization_gap():
    agent, reports, validation = _overfit(n_train=64, steps=120, seed=1)
    verdicts = [v for v in agent.detector.history if v.pattern == "generalization_gap"]
    best = min(validation, key=lambda sv: sv[1])[0]
    assert reports[-1].loss < 0.05 * reports[0].loss, "the training loss falls"
    assert validation[-1][1] > 1.3 * min(v for _, v in validation), "the validation loss rises"
    # gap_validations=3 rises after the best (step 20): named at the step after the third one.
    assert best == 20 and [(v.step, v.block) for v in verdicts] == [(51, None)], (
        validation,
        verdicts,
    )
    assert fired(agent) == [("generalization_gap", None, 51)]


def test_no_generalization_gap_while_validation_follows_training():
    agent, _reports, validation = _overfit(n_train=4096, steps=120, seed=1)
    assert validation[-1][1] < 0.7 * validation[0][1]
    assert fired(agent) == []


def test_no_second_generalization_gap_on_a_converged_plateau():
    """After memorising its 32 samples the model stops moving: from step ~200 the validation
    loss is constant to 0.02% and the training loss is ~1e-9. Nothing new happens there, so the
    gap reported at step 41 must not be reported again. (Fails until the rule asks for the rise
    within its window: today it re-fires at step 271 on validation losses
    [1.54257, 1.54257, 1.54257, 1.54257] that rise in the 7th digit, because "rising" has no
    minimum step and the 2% is measured against the best of the whole run.)"""
    agent, _reports, validation = _overfit(n_train=32, steps=300, seed=1)
    late = [v for s, v in validation if s >= 200]
    assert max(late) - min(late) < 2e-4 * min(late), "the plateau is flat"
    assert fired(agent) == [("generalization_gap", None, 41)], [
        (v.step, v.evidence["validation"]) for v in agent.detector.history
    ]
