"""The watchdog in one process: healthy checkpoints, rollback, LR back-off, skips, resume, guard."""

import json
import logging

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
    "nan_from_23": lambda s, loss: loss * float("nan") if s >= 23 else loss,
    "loss_x100_from_21": lambda s, loss: loss * 100 if s > 20 else loss,
}
"""Faults that come back after every rollback (checkpoints every 10 steps)."""


def test_a_fault_after_every_rollback_escalates_then_aborts_with_the_exit_code(tmp_path):
    """NaN from step 23 on, whatever the weights: the first rollback goes to step 20 (trusted:
    21 and 22 were clean); the NaN comes back at 23, so 20 is distrusted and the repeat goes
    to 10 with the learning rate cut twice (0.125) and twice the margin; the replay saves a new
    20, trusted afresh; the NaN comes back again, so 10 is distrusted and the next repeat goes
    to the new 20 (cut three times more). The fourth rollback is past ``max_rollbacks``: an
    abort with the exit code, never a loop."""
    model, opt, _sched, agent = setup(tmp_path, max_rollbacks=3, abort_exit_code=79)
    reports = []
    with pytest.raises(torchvitals.TrainingAborted) as info:
        train(model, opt, agent, 60, inject=RETURNING["nan_from_23"], reports=reports)
    assert isinstance(info.value, SystemExit) and info.value.code == 79
    assert "4 rollbacks within 500 steps" in info.value.why
    rolled = [(r.step, r.rollback) for r in reports if r.rollback is not None]
    assert [(at, r.to_step, r.lr_scale, r.repeat_of, r.escalation) for at, r in rolled] == [
        (23, 20, 0.5, None, 0),
        (23, 10, 0.125, 23, 1),
        (23, 20, 0.015625, 23, 2),
    ]
    assert [r.skipped[1] - r.skipped[0] for _, r in rolled][:2] == [5, 22]  # margins 2, 4
    assert {r.action for r in reports} <= {"step", "rollback"}
    assert agent.watchdog.rollbacks == 3
    assert agent.detector.history[-1].pattern == "rollback_loop"
    ledger = json.loads((tmp_path / "ckpt" / "ledger.json").read_text())
    assert [(e["event"], e["step"]) for e in ledger["entries"]] == [
        ("checkpoint", 10),
        ("trust", 10),
        ("checkpoint", 20),
        ("trust", 20),
        ("rollback", 23),
        ("distrust", 20),
        ("rollback", 23),
        ("checkpoint", 20),
        ("trust", 20),
        ("distrust", 10),
        ("rollback", 23),
        ("abort", 23),
    ]
    assert [e.get("repeat_of") for e in ledger["entries"] if e["event"] == "rollback"] == [
        None,
        23,
        23,
    ]
    assert ledger["lr_scale"] == 0.015625
    agent.close()


def test_a_spike_right_after_a_checkpoint_goes_further_back_and_aborts_when_none_is_left(
    tmp_path,
):
    """Loss x 100 from step 21 on: step 21 is an outlier (its update skipped), one step after
    the checkpoint of step 20, which may hold the update that caused it: 20 is distrusted and
    the rollback at 22 goes to 10. The spike persists: the detector judges it against the
    healthy level it had learnt before the rollback (one that started afresh would accept x 100
    as the new normal). The rollback to 10 did not cure, so 10 is distrusted; the replay's new
    20, distrusted the same way as the first, is the last resort: a repeat to it with the LR cut
    twice more. That does not cure either, and with no checkpoint left the job aborts, saying
    so."""
    model, opt, _sched, agent = setup(tmp_path, max_rollbacks=3, abort_exit_code=79)
    reports = []
    with pytest.raises(torchvitals.TrainingAborted) as info:
        train(model, opt, agent, 60, inject=RETURNING["loss_x100_from_21"], reports=reports)
    assert info.value.code == 79 and "no trusted checkpoint is left" in info.value.why
    rolled = [(r.step, r.rollback.to_step, r.rollback.repeat_of) for r in reports if r.rollback]
    assert rolled == [(22, 10, None), (22, 20, 22)]
    assert [r.step for r in reports if r.action == "skip"] == [21, 21, 21]
    ledger = json.loads((tmp_path / "ckpt" / "ledger.json").read_text())
    assert [(e["event"], e["step"]) for e in ledger["entries"]] == [
        ("checkpoint", 10),
        ("trust", 10),
        ("checkpoint", 20),
        ("distrust", 20),
        ("rollback", 22),
        ("distrust", 20),
        ("checkpoint", 20),
        ("distrust", 20),
        ("distrust", 10),
        ("rollback", 22),
        ("distrust", 20),
        ("abort", 22),
    ]
    why = [e["reason"] for e in ledger["entries"] if e["event"] == "distrust"]
    assert why[0].startswith("loss_outlier at step 21, 1 step(s) after it")
    assert why[1].startswith("newer than step 10, which the rollback at step 22 went back to")
    assert why[3].startswith("the rollback to it at step 22 did not cure the run")
    agent.close()


def test_with_only_a_checkpoint_trouble_followed_it_is_the_last_resort_then_the_abort(
    tmp_path,
):
    """NaN at every step from 12 on: the checkpoint of 10 is followed by trouble within
    trust_steps, but it is the only one: the rollback goes there as a last resort; the NaN comes
    back, so 10 failed too, and the job aborts instead of skipping every step from then on."""
    model, opt, _sched, agent = setup(tmp_path, abort_exit_code=79)
    reports = []
    with pytest.raises(torchvitals.TrainingAborted) as info:
        inject = lambda s, loss: loss * float("nan") if s >= 12 else loss  # noqa: E731
        train(model, opt, agent, 60, inject=inject, reports=reports)
    assert "no trusted checkpoint is left" in info.value.why
    assert [(r.step, r.rollback.to_step) for r in reports if r.rollback] == [(12, 10)]
    ledger = json.loads((tmp_path / "ckpt" / "ledger.json").read_text())
    assert [e["event"] for e in ledger["entries"]] == [
        "checkpoint",
        "distrust",
        "rollback",
        "distrust",
        "abort",
    ]
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


def test_a_restart_never_resumes_from_a_checkpoint_trouble_followed(tmp_path, caplog):
    """One outlier at step 21, one step after the checkpoint of 20: its update is skipped and
    20 is distrusted. A crash at 25 restarts from 10, not from 20, which may hold the update
    that caused the outlier."""
    model, opt, _sched, agent = setup(tmp_path)
    reports = train(model, opt, agent, 25, inject=lambda s, v: v * 100 if s == 21 else v)
    assert [(r.step, r.action) for r in reports if r.action != "step"] == [(21, "skip")]
    agent.close()
    with caplog.at_level(logging.WARNING, "torchvitals"):
        _model2, _opt2, _sched2, again = setup(tmp_path, resume="auto")
    assert again.resumed_from == 10
    assert any(
        "ignoring" in r.getMessage()
        and "step-00000020: distrusted (loss_outlier at step 21" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    again.close()


def test_with_a_ramp_the_learning_rate_returns_to_schedule_once_the_rollback_cured(tmp_path):
    """A NaN once at step 23: the rollback to 20 halves the learning rate; 20 steps past 23 the
    rollback has cured the run, and over ``lr_ramp_steps`` (10) the scale climbs back to 1,
    which the ledger records, so a restart resumes at full rate. Without the setting the
    back-off stays (the default)."""
    model, opt, _sched, agent = setup(tmp_path, lr_ramp_steps=10, verify_steps=20)
    scales: dict[int, float] = {}
    inject = nan_once_at(23)
    while agent.step_count < 60:
        for x, y in agent.batches(BATCHES):
            loss = inject(agent.step_count + 1, model.loss(x, y))
            loss.backward()
            report = agent.step(loss)
            opt.zero_grad(set_to_none=True)
            scales[report.step] = agent.lr_scale
            if agent.step_count >= 60:
                break
    assert [scales[s] for s in (30, 42, 43, 48, 53, 60)] == pytest.approx(
        [0.5, 0.5, 0.5, 0.75, 1.0, 1.0]
    )
    agent.close()
    ledger = json.loads((tmp_path / "ckpt" / "ledger.json").read_text())
    events = [(e["event"], e["step"]) for e in ledger["entries"]]
    assert [e for e in events if e[0] in ("rollback", "ramp")] == [("rollback", 23), ("ramp", 53)]
    # Each checkpoint earns trust after it commits (a background write: when it lands).
    assert [s for e, s in events if e == "trust"] == [10, 20, 30, 40, 50]
    assert ledger["lr_scale"] == 1.0
    _model2, _opt2, _sched2, again = setup(tmp_path, resume="auto")
    assert again.lr_scale == 1.0
    again.close()
    model, opt, _sched, kept = setup(tmp_path / "default")
    train(model, opt, kept, 60, inject=nan_once_at(23))
    assert kept.lr_scale == 0.5, "off by default: the back-off stays"
    kept.close()
