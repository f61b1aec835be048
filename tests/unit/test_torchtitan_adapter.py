"""``watch_torchtitan`` in one process without torchtitan installed: a trainer with torchtitan
0.3.0's shape (``model_parts``, an optimizer container, a scheduler container, ``loss_fn``
returning the local token sum over the global token count, and a ``train_step`` that clips,
steps, schedules, then raises "Loss is not finite" for a non-finite logged loss). The real
Trainer under torchrun: tests/integration/test_torchtitan.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support.llamalike import LlamaLike

import torchvitals
from torchvitals.errors import TorchvitalsError

VOCAB = 64


class Optimizers(torch.optim.Optimizer):
    def __init__(self, model):
        self.optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
        torch.optim.Optimizer.__init__(self, list(model.parameters()), {})

    def __iter__(self):
        return iter(self.optimizers)

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class Schedulers:
    def __init__(self, optimizers):
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.1 * s)) for o in optimizers
        ]

    def step(self):
        for s in self.schedulers:
            s.step()

    def state_dict(self):
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state):
        for s in self.schedulers:
            s.last_epoch, s._step_count = state["last_epoch"], state["last_epoch"] + 1


class Dims:
    dp_cp_enabled = False


class Trainer:
    """torchtitan's Trainer loop, one process, gradient accumulation of two micro-batches."""

    def __init__(self, steps, fault_step=0):
        torch.manual_seed(0)
        self.model_parts = [LlamaLike(vocab=VOCAB, fused=True)]
        self.optimizers = Optimizers(self.model_parts[0])
        self.lr_schedulers = Schedulers(self.optimizers)
        self.parallel_dims = Dims()
        self.loss_fn = self._loss
        self.steps, self.fault_step, self.step, self.ntokens_seen = steps, fault_step, 0, 0
        self.logged, self.faulted = [], False
        self.g = torch.Generator().manual_seed(1)

    def _loss(self, pred, labels, global_tokens):
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        return loss / global_tokens, None

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]

    def train_step(self, data):
        self.optimizers.zero_grad()
        batches = [torch.randint(0, VOCAB, (2, 9), generator=self.g) for _ in range(2)]
        tokens = sum(b[:, 1:].numel() for b in batches)
        total = 0.0
        for b in batches:
            loss, _ = self.loss_fn(self.model_parts[0](b[:, :-1]), b[:, 1:], tokens)
            if self.step == self.fault_step and not self.faulted:
                self.faulted, loss = True, loss * float("nan")
            loss.backward()
            total += float(loss.detach())
        params = list(self.model_parts[0].parameters())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
        self.optimizers.step()
        self.lr_schedulers.step()
        if not math.isfinite(total):
            raise RuntimeError(
                f"Loss is not finite (global_avg_loss={total}) at step "
                f"{self.step}. Stopping training."
            )
        self.logged.append((self.step, total, float(norm)))

    def train(self):
        while self.step < self.steps:
            self.step += 1
            self.train_step(None)


def run(trainer, **config):
    agent = torchvitals.watch_torchtitan(trainer, metrics_port=0, log_dir="", **config)
    reports = []
    step = trainer.train_step

    def recording(data):
        try:
            return step(data)
        finally:
            reports.append(agent.last_report)

    trainer.__dict__["train_step"] = recording
    try:
        trainer.train()
    finally:
        del trainer.__dict__["train_step"]
        agent.close()
    return agent, reports


def test_loss_blocks_and_clip_norm_are_the_trainers():
    trainer = Trainer(steps=6)
    agent, reports = run(trainer)
    assert agent.block_names[:2] == ["tok_embeddings", "layers.0"]
    assert [r.step for r in reports] == list(range(1, 7))
    for r, (step, loss, norm) in zip(reports, trainer.logged):
        assert r.step == step and r.loss == pytest.approx(loss, rel=1e-6)
        assert r.grad_norm_total == pytest.approx(norm, rel=1e-6)
    assert "loss_fn" in vars(trainer) and vars(trainer)["loss_fn"] == trainer._loss  # put back
    assert "train_step" not in vars(trainer)


def test_a_rolled_back_nan_does_not_stop_the_run_and_the_step_counter_follows(tmp_path):
    trainer = Trainer(steps=12, fault_step=8)
    agent, reports = run(
        trainer,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=3,
        healthy_window=0,
        trust_steps=1,  # step 6's checkpoint is the target of the fault at 8
    )
    rollbacks = [r for r in reports if r.action == "rollback"]
    assert [(r.step, r.rollback.to_step) for r in rollbacks] == [(8, 6)]
    assert agent.adapter.absorbed == [8]
    assert trainer.step == agent.step_count == 12
    assert trainer.lr_schedulers.schedulers[0].last_epoch == 12
    assert [s for s, _, _ in trainer.logged] == [*range(1, 8), *range(7, 13)]


def test_a_skipped_nan_is_absorbed_and_any_other_error_still_stops_the_run():
    trainer = Trainer(steps=6, fault_step=3)
    agent, reports = run(trainer)  # no checkpoint_dir: the NaN step is skipped
    assert [r.action for r in reports] == ["step", "step", "skip", "step", "step", "step"]
    assert agent.adapter.absorbed == [3] and trainer.step == 6
    assert all(torch.isfinite(p).all() for p in trainer.model_parts[0].parameters())

    broken = Trainer(steps=3)

    def loss_fn(*args):
        raise RuntimeError("Loss is not finite, but no step of torchvitals said so")

    broken.loss_fn = loss_fn
    with pytest.raises(RuntimeError, match="no step of torchvitals"):
        run(broken)


def test_several_model_parts_are_refused():
    trainer = Trainer(steps=1)
    trainer.model_parts.append(LlamaLike(vocab=VOCAB))
    with pytest.raises(TorchvitalsError, match="pipeline parallelism"):
        torchvitals.watch_torchtitan(trainer)
