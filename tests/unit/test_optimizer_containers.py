"""``watch()`` with an optimizer container shaped like torchtitan's ``OptimizersContainer``:
several optimizers inside one object whose own param group has no ``lr``.

The container here copies torchtitan 0.3.0's shape (an ``Optimizer`` subclass initialised with
every parameter and no defaults, ``.optimizers``, iteration, a delegating ``step``) and its
scheduler container (one LambdaLR per optimizer, ``state_dict() == {"last_epoch": n}``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchvitals
from torchvitals.errors import TorchvitalsError


class Container(torch.optim.Optimizer):
    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        torch.optim.Optimizer.__init__(self, params, {})

    def __iter__(self):
        return iter(self.optimizers)

    def __len__(self):
        return len(self.optimizers)

    def step(self, closure=None):
        assert closure is None
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class Schedulers:
    def __init__(self, optimizers, lr_lambda):
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in optimizers]

    def step(self):
        for s in self.schedulers:
            s.step()

    def state_dict(self):
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state):
        for s in self.schedulers:
            s.last_epoch = state["last_epoch"]
            s._step_count = state["last_epoch"] + 1
            s._last_lr = [base * s.lr_lambdas[0](s.last_epoch) for base in s.base_lrs]


def two_parts(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )
    # one with state (momentum), one without: DCP treats the two differently
    first = torch.optim.SGD(
        list(model[0].parameters()) + list(model[2].parameters()), lr=0.02, momentum=0.9
    )
    second = torch.optim.SGD(model[4].parameters(), lr=0.01)
    return model, Container([first, second])


def loss_of(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 6, generator=g)
    return ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()


def watch(model, opt, sched=None, **config):
    return torchvitals.watch(model, opt, sched, metrics_port=0, log_dir="", **config)


def lr_seen(container):
    """The LR each inner group had when its optimizer really stepped, per step."""
    seen = []

    def hook(opt, args, kwargs):
        seen.append([g["lr"] for g in opt.param_groups])

    for o in container.optimizers:
        o.register_step_pre_hook(hook)
    return seen


def test_the_container_step_is_one_agent_step_and_every_lr_is_reported():
    model, opt = two_parts()
    sched = Schedulers(opt, lambda s: 0.9**s)
    agent = watch(model, opt, sched)
    try:
        for s in range(1, 6):
            loss_of(model, s).backward()
            agent.record_loss(loss_of(model, s))
            opt.step()
            sched.step()
            opt.zero_grad()
            report = agent.last_report
            assert report.step == s and report.action == "step"
            assert report.lr == pytest.approx([0.02 * 0.9 ** (s - 1), 0.01 * 0.9 ** (s - 1)])
    finally:
        agent.close()


def test_a_rollback_backs_off_every_inner_optimizer_and_restores_their_state(tmp_path):
    model, opt = two_parts()
    sched = Schedulers(opt, lambda s: 1.0)
    seen = lr_seen(opt)
    agent = watch(
        model,
        opt,
        sched,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=4,
        healthy_window=0,
        trust_steps=1,  # step 4's checkpoint is the target of the NaN at 6
    )
    try:
        for s in range(1, 10):
            loss = loss_of(model, s)
            if s == 6:
                loss = loss * float("nan")
            loss.backward()
            if s == 6:
                for p in model.parameters():
                    p.grad.fill_(float("nan"))
            if s == 5:
                at_four = {k: v.clone() for k, v in model.state_dict().items()}
            agent.record_loss(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            report = agent.last_report
            if s == 6:
                assert report.action == "rollback" and report.rollback.to_step == 4
                restored = model.state_dict()
                assert all(torch.equal(restored[k], at_four[k]) for k in at_four)
        # after the rollback every inner optimizer stepped at half its own rate
        assert seen[-6:] == [[0.01], [0.005]] * 3
        assert agent.last_report.lr == pytest.approx([0.01, 0.005])
        assert [g["lr"] for o in opt.optimizers for g in o.param_groups] == [0.02, 0.01]
    finally:
        agent.close()


def test_anything_else_is_refused_naming_what_to_pass():
    model, _opt = two_parts()
    with pytest.raises(TorchvitalsError, match="OptimizersContainer"):
        watch(model, object())
    bare = torch.optim.Optimizer(model.parameters(), {})  # no lr, nothing inside
    with pytest.raises(TorchvitalsError, match="have no 'lr'"):
        watch(model, bare)


def test_a_restart_resumes_both_optimizers_from_the_disk_with_the_back_off(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    model, opt = two_parts()
    agent = watch(
        model, opt, checkpoint_dir=ckpt, checkpoint_every=4, healthy_window=0, trust_steps=1
    )
    try:
        s = 0
        while agent.last_report is None or agent.last_report.step < 8:  # 8 agent steps
            s += 1
            loss = loss_of(model, s) * (float("nan") if s == 6 else 1.0)
            loss.backward()
            agent.record_loss(loss)
            opt.step()
            opt.zero_grad()
        assert s == 10  # steps 5-6 ran twice: the rollback at 6 went back to step 4
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        momenta = [st["momentum_buffer"].clone() for st in opt.optimizers[0].state.values()]
    finally:
        agent.close()
    model2, opt2 = two_parts(seed=3)
    seen = lr_seen(opt2)
    again = watch(
        model2,
        opt2,
        checkpoint_dir=ckpt,
        checkpoint_every=4,
        healthy_window=0,
        trust_steps=1,
        resume="auto",
    )
    try:
        assert again.resumed_from == 8
        assert all(torch.equal(model2.state_dict()[k], saved[k]) for k in saved)
        loss_of(model2, 9).backward()
        again.record_loss(loss_of(model2, 9))
        opt2.step()
        assert seen[-2:] == [[0.01], [0.005]]  # (earlier: DCP's zero-lr state-init steps)
    finally:
        again.close()
    assert momenta and len(opt2.optimizers[0].state) == len(momenta)


class PlainContainer:
    """A container that is no torch Optimizer: only iteration, step and zero_grad."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)

    def __iter__(self):
        return iter(self.optimizers)

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def test_a_container_that_is_not_an_optimizer_is_guarded_too():
    model, opt = two_parts()
    plain = PlainContainer(opt.optimizers)
    agent = watch(model, plain)
    try:
        for s in range(1, 4):
            loss_of(model, s).backward()
            agent.record_loss(loss_of(model, s))
            plain.step()
            plain.zero_grad()
            assert agent.last_report.step == s and agent.last_report.lr == [0.02, 0.01]
    finally:
        agent.close()
    assert "step" not in vars(plain)  # its own step is back
