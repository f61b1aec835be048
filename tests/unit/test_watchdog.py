"""The watchdog in one process: healthy checkpoints, rollback, LR back-off, skips, resume, guard."""

import json

import pytest
import torch
from support.models import TINY, TinyGPT, random_batches

import torchvitals

BATCHES = list(random_batches(80, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))


def setup(tmp_path, **config):
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    settings = dict(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10, healthy_window=5)
    settings.update(config)
    return model, opt, sched, torchvitals.watch(model, opt, sched, **settings)


def train(model, opt, agent, steps, inject=None, seen=None, reports=None):
    reports = [] if reports is None else reports  # passed in: kept when the run aborts
    while agent.step_count < steps:
        for x, y in agent.batches(BATCHES):
            if seen is not None:
                seen.append(int(x[0, 0]) * 1000 + int(x[0, 1]))
            loss = model.loss(x, y)
            if inject is not None:
                loss = inject(agent.step_count + 1, loss)
            loss.backward()
            report = agent.step(loss)
            opt.zero_grad(set_to_none=True)
            reports.append(report)
            if agent.step_count >= steps:
                break
    return reports


def nan_once_at(at):
    fired = []

    def inject(step, loss):
        if step == at and not fired:
            fired.append(step)
            return loss * float("nan")
        return loss

    return inject


def test_nan_rolls_back_to_the_last_healthy_checkpoint(tmp_path):
    model, opt, sched, agent = setup(tmp_path)
    reports = train(model, opt, agent, 40, inject=nan_once_at(27))
    rollbacks = [r for r in reports if r.action == "rollback"]
    assert len(rollbacks) == 1
    rb = rollbacks[0]
    assert rb.step == 27 and rb.rollback.to_step == 20 and rb.rollback.lr_scale == 0.5
    assert rb.rollback.skipped == (20, 29)  # checkpoint position .. batch 27 + margin 2
    assert agent.skipped_batches == [(20, 29)]
    assert [r.step for r in reports if r.checkpoint.saved] == [10, 20, 30, 40]
    assert agent.lr_scale == 0.5
    # The scheduler keeps the intended rate; the back-off applies at each step over it.
    assert sched.base_lrs == [pytest.approx(3e-3)] * len(sched.base_lrs)
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3)
    assert reports[-1].lr == [pytest.approx(1.5e-3)]
    ledger = json.loads((tmp_path / "ckpt" / "ledger.json").read_text())
    assert ledger["lr_scale"] == 0.5 and ledger["skipped"] == [[20, 29]]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    agent.close()


def test_restart_resumes_position_lr_scale_and_skips(tmp_path):
    model, opt, _sched, agent = setup(tmp_path)
    train(model, opt, agent, 35, inject=nan_once_at(27))
    agent.close()
    expected = {n: p.detach().clone() for n, p in model.state_dict().items()}
    position = agent.data_position
    # A restarted process (resume="auto"): same folder -> resumes from step 30's checkpoint.
    model2, opt2, _sched2, agent2 = setup(tmp_path, resume="auto")
    assert agent2.resumed_from == 30 and agent2.step_count == 30
    assert agent2.lr_scale == 0.5 and agent2.skipped_batches == [(20, 29)]
    assert opt2.param_groups[0]["lr"] == pytest.approx(3e-3)
    seen = []
    train(model2, opt2, agent2, 35, seen=seen)
    assert agent2.data_position == position
    for name, value in model2.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    agent2.close()


RETURNING = {
    "nan_from_23": (23, [], lambda s, loss: loss * float("nan") if s >= 23 else loss),
    "loss_x100_from_21": (22, [21] * 4, lambda s, loss: loss * 100 if s > 20 else loss),
}
"""Faults that come back after every rollback to step 20: the step the watchdog rolls back at,
the steps whose update it skipped, and the fault. A non-finite step rolls back at once; a loss
spike's first step is an outlier (the next batch might have healed it): its update is skipped,
and the second step past the threshold rolls back."""


@pytest.mark.parametrize("fault", sorted(RETURNING))
def test_a_fault_after_every_rollback_aborts_with_the_exit_code(tmp_path, fault):
    """Every rollback to step 20 meets the fault again. ``loss_x100_from_21`` is a spike that
    persists: the detector must judge it against the healthy level it had learnt before the
    rollback; one that starts afresh accepts x 100 as the new normal and trains on."""
    at, skipped, inject = RETURNING[fault]
    model, opt, _sched, agent = setup(tmp_path, max_rollbacks=3, abort_exit_code=79)
    reports = []
    with pytest.raises(torchvitals.TrainingAborted) as info:
        train(model, opt, agent, 60, inject=inject, reports=reports)
    assert isinstance(info.value, SystemExit) and info.value.code == 79
    rollbacks = [r for r in reports if r.action == "rollback"]
    assert [(r.step, r.action) for r in rollbacks] == [(at, "rollback")] * 3
    assert [r.step for r in reports if r.action == "skip"] == skipped
    assert {r.action for r in reports} <= {"step", "skip", "rollback"}
    assert [r.rollback.to_step for r in rollbacks] == [20] * 3
    assert [r.rollback.lr_scale for r in rollbacks] == [0.5, 0.25, 0.125]
    assert agent.watchdog.rollbacks == 3
    assert agent.detector.history[-1].pattern == "rollback_loop"
    ledger = json.loads((tmp_path / "ckpt" / "ledger.json").read_text())
    assert [e["event"] for e in ledger["entries"]] == [
        "checkpoint",
        "checkpoint",
        "rollback",
        "rollback",
        "rollback",
        "abort",
    ]
    assert ledger["lr_scale"] == 0.125
    agent.close()


def test_without_a_checkpoint_yet_a_critical_step_is_skipped(tmp_path):
    model, opt, _sched, agent = setup(tmp_path)
    reports = train(model, opt, agent, 5, inject=lambda s, v: v * float("nan") if s == 3 else v)
    assert [r.action for r in reports] == ["step", "step", "skip", "step", "step"]
    agent.close()


class CountingTokens(torch.utils.data.Dataset):
    """Token sequences that count how often they are read."""

    def __init__(self, n: int):
        self.items = [
            (x[0], y[0])
            for x, y in random_batches(
                n, batch=1, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=3
            )
        ]
        self.reads = 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.reads += 1
        return self.items[i]


def test_stateful_loader_resumes_without_reading_anything_twice(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def run(steps):
        data = CountingTokens(400)
        loader = StatefulDataLoader(
            data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
        )
        model, opt, _sched, agent = setup(tmp_path, resume="auto")
        start = agent.step_count
        while agent.step_count < steps:
            for x, y in agent.batches(loader):
                loss = model.loss(x, y)
                loss.backward()
                agent.step(loss)
                opt.zero_grad(set_to_none=True)
                if agent.step_count >= steps:
                    break
        agent.close()
        return model, data.reads, start

    _first, reads, _ = run(35)  # checkpoints at 10, 20, 30
    assert reads == 35 * 4
    resumed, reads, start = run(45)  # a new process: resumes at step 30
    assert start == 30 and reads == (45 - 30) * 4, "the resume read batches again"
    (tmp_path / "ckpt").rename(tmp_path / "first")
    straight, _, _ = run(45)
    for (name, a), b in zip(resumed.state_dict().items(), straight.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
