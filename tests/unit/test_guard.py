"""The guarded optimizer in one process: every way a loop can step, what the report says, and
the mistakes it refuses (a double step, a step around the guard)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

import torchvitals
from torchvitals.agent.guard import DoubleStepError, GuardBypassedError
from torchvitals.agent.recover.watchdog import ResumeRefused


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 6, generator=g)
    return x, x.sum(1, keepdim=True)


def loss_of(model: nn.Module, seed: int) -> torch.Tensor:
    x, y = batch(seed)
    return ((model(x) - y) ** 2).mean()


def grad_total(model: nn.Module) -> float:
    return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))


def watch(model, opt, **config):
    config.setdefault("metrics_port", 0)
    config.setdefault("log_dir", "")
    return torchvitals.watch(model, opt, **config)


def test_optimizer_step_with_a_closure_is_measured_and_steps_once():
    model, ref = mlp(), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    agent = watch(model, opt)
    steps = []
    opt.register_step_post_hook(lambda *a: steps.append(1))
    for s in range(3):

        def closure(s=s):
            opt.zero_grad()
            loss = loss_of(model, s)
            loss.backward()
            return loss

        returned = opt.step(closure)
        ref_opt.zero_grad()
        ref_loss = loss_of(ref, s)
        ref_loss.backward()
        expected_total = grad_total(ref)
        ref_opt.step()
        report = agent.last_report
        assert report.step == s + 1 and report.action == "step"
        assert report.loss == pytest.approx(ref_loss.item(), rel=1e-6)
        assert returned.item() == pytest.approx(ref_loss.item(), rel=1e-6)
        assert report.grad_norm_total == pytest.approx(expected_total, rel=1e-5)
    assert len(steps) == 3
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    agent.close()


def test_micro_batch_losses_average_and_a_model_output_loss_counts():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = watch(model, opt)
    losses = [loss_of(model, s) for s in range(4)]  # gradient accumulation over 4
    for loss in losses:
        agent.record_loss(loss)  # the unscaled micro-batch loss
        (loss / 4).backward()
    opt.step()
    assert agent.last_report.loss == pytest.approx(sum(v.item() for v in losses) / 4, rel=1e-6)

    class WithLoss(nn.Module):  # an HF-style output with .loss
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            return {"loss": ((self.inner(x) - y) ** 2).mean()}

    wrapped = WithLoss(mlp(1))
    opt2 = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    agent2 = watch(wrapped, opt2)
    out = [wrapped(*batch(s)) for s in (5, 6)]
    for o in out:
        (o["loss"] / 2).backward()
    opt2.step()
    assert agent2.last_report.loss == pytest.approx(
        (float(out[0]["loss"]) + float(out[1]["loss"])) / 2
    )
    agent.close()
    agent2.close()


def test_a_step_without_any_loss_still_measures_gradients():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = watch(model, opt)
    loss_of(model, 0).backward()
    expected = grad_total(model)
    opt.step()
    report = agent.last_report
    assert math.isnan(report.loss) and not report.nonfinite and report.action == "step"
    assert report.grad_norm_total == pytest.approx(expected, rel=1e-5)
    assert not report.verdicts
    agent.close()


def test_a_second_step_on_the_same_gradients_is_refused_loudly():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = watch(model, opt)
    loss = loss_of(model, 0)
    loss.backward()
    agent.step(loss)  # a callback stepping ...
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DoubleStepError, match="no backward pass since the last step"):
        opt.step()  # ... and then the framework
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    opt.zero_grad(set_to_none=True)
    loss = loss_of(model, 1)
    loss.backward()
    assert agent.step(loss).action == "step"  # the next real step is fine
    agent.close()


def test_a_step_around_the_guard_is_refused_before_it_changes_anything():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    early = opt.step  # a reference taken before watch()
    agent = watch(model, opt)
    loss_of(model, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(GuardBypassedError, match="without torchvitals"):
        early()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    agent.close()
    early()  # after close() the optimizer is its own again
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_the_back_off_survives_a_learning_rate_set_by_hand_every_step(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = watch(
        model, opt, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=5, healthy_window=0
    )
    for s in range(1, 13):
        for group in opt.param_groups:  # nanoGPT: the loop owns the LR
            group["lr"] = 0.01
        loss = loss_of(model, s)
        if s == 8:
            loss = loss * float("nan")
        loss.backward()
        if s == 11:
            grads = [p.grad.clone() for p in model.parameters()]
            before = [p.detach().clone() for p in model.parameters()]
        report = agent.step(loss)
        opt.zero_grad(set_to_none=True)
        if s == 8:
            assert report.action == "rollback" and report.rollback.lr_scale == 0.5
        if s == 11:
            assert report.lr == [pytest.approx(0.005)]
            for p, b, g in zip(model.parameters(), before, grads):  # SGD: w -= lr * g
                torch.testing.assert_close(p.detach(), b - 0.005 * g)
    assert opt.param_groups[0]["lr"] == 0.01  # the loop's value, untouched
    agent.close()


def test_clipping_in_the_loop_is_measured_before_it_clips():
    model, ref = mlp(), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = watch(model, opt)
    loss = loss_of(model, 0)
    loss.backward()
    ref_loss = loss_of(ref, 0)
    ref_loss.backward()
    pre_clip = grad_total(ref)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # as nanoGPT, Lightning, HF do
    report = agent.step(loss)
    assert report.grad_norm_total == pytest.approx(pre_clip, rel=1e-5)
    assert grad_total(model) == pytest.approx(1e-3, rel=1e-3)  # the optimizer got clipped grads
    agent.close()


def test_clipping_through_a_name_imported_before_watch_is_measured_before_it_clips():
    from torch.nn.utils import clip_grad_norm_ as bound_early  # not the attribute
    from torch.nn.utils.clip_grad import clip_grad_norm_ as bound_deep

    model, ref = mlp(), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    agent = watch(model, opt)
    for s, clip in enumerate((bound_early, bound_deep, torch.nn.utils.clip_grads_with_norm_)):
        loss = loss_of(model, s)
        loss.backward()
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        loss_of(ref, s).backward()
        pre_clip = grad_total(ref)
        if clip is torch.nn.utils.clip_grads_with_norm_:  # torchtitan's two-step clip
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            clip(model.parameters(), 1e-3, norm)
        else:
            clip(model.parameters(), 1e-3)
        assert grad_total(model) == pytest.approx(1e-3, rel=1e-3)
        report = agent.step(loss)
        assert report.grad_norm_total == pytest.approx(pre_clip, rel=1e-5), clip
        opt.zero_grad(set_to_none=True)
    agent.close()


def own_clip(params, max_norm: float) -> None:
    """A loop's hand-written clipping: nothing torchvitals can intercept."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    for g in grads:
        g.mul_(min(1.0, max_norm / (float(total) + 1e-6)))


def test_clipping_the_agent_cannot_see_is_flagged(caplog):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    agent = watch(model, opt)
    with caplog.at_level(logging.WARNING):
        for s in range(6):
            loss = loss_of(model, s)
            loss.backward()
            own_clip(list(model.parameters()), 0.01)
            agent.step(loss)
            opt.zero_grad(set_to_none=True)
    assert "look clipped before torchvitals measured them" in caplog.text
    agent.close()


def test_a_scaler_the_loop_already_unscaled_is_accepted():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    agent = watch(model, opt)
    loss = loss_of(model, 0)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # to clip, as nanoGPT does
    true_total = grad_total(model)
    report = agent.step(loss, scaler=scaler)
    assert report.action == "step" and report.loss_scale == 2.0**10
    assert report.grad_norm_total == pytest.approx(true_total, rel=1e-5)
    agent.close()


def test_scaler_step_is_routed_for_the_watched_optimizer_only_and_given_back_at_close():
    scaler_step = torch.amp.GradScaler.step
    model, other = mlp(0), mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    agent = watch(model, opt)
    for net, o in ((model, opt), (other, other_opt)):
        scaler.scale(loss_of(net, 0)).backward()
        scaler.step(o)
    scaler.update()
    assert agent.last_report is not None and agent.last_report.loss_scale == 2.0**10
    assert agent.step_count == 1, "the other optimizer's step is the scaler's own"
    assert all(p.grad is not None for p in other.parameters())
    agent.close()
    assert torch.amp.GradScaler.step is scaler_step
    opt.zero_grad()
    scaler.scale(loss_of(model, 1)).backward()
    scaler.step(opt)  # no agent any more: torch's own step
    assert agent.step_count == 1


def test_gradients_measured_before_a_step_the_loop_skipped_are_not_reported_later():
    """A loop that clips, sees a non-finite norm and skips the step itself (no optimizer.step):
    the next step reports its own gradients, not the skipped step's Inf."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = watch(model, opt)
    (loss_of(model, 0) * float("inf")).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert not torch.isfinite(norm)
    opt.zero_grad(set_to_none=True)  # the loop's own skip
    loss = loss_of(model, 1)
    loss.backward()
    true_total = grad_total(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    report = agent.last_report
    assert report.step == 1 and not report.nonfinite_grad and report.action == "step"
    assert report.grad_norm_total == pytest.approx(true_total, rel=1e-5)
    agent.close()


def test_a_wrapper_around_the_guarded_step_runs_once_per_step_and_sees_a_scaler_step():
    """A wrapper installed on ``optimizer.step`` after watch (a profiler's, or accelerate's
    "it really stepped" marker) runs once per step, whether the loop calls ``optimizer.step()``
    or its GradScaler's ``step``."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = watch(model, opt)
    calls = []
    guarded = opt.step

    def wrapper(*args, **kwargs):
        calls.append(agent.step_count)
        return guarded(*args, **kwargs)

    opt.step = wrapper
    loss_of(model, 0).backward()
    opt.step()
    assert calls == [0] and agent.step_count == 1
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(loss_of(model, 1)).backward()
    scaler.step(opt)  # the scaler calls the optimizer's current step once
    scaler.update()
    assert calls == [0, 1] and agent.step_count == 2
    agent.close()


def test_a_fresh_run_refuses_a_folder_holding_another_run(tmp_path, monkeypatch, caplog):
    ckpt = str(tmp_path / "ckpt")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = watch(model, opt, checkpoint_dir=ckpt, checkpoint_every=2, healthy_window=0)
    for s in range(4):
        loss = loss_of(model, s)
        loss.backward()
        agent.step(loss)
        opt.zero_grad()
    agent.close()

    def fresh():
        m = mlp()
        return m, torch.optim.SGD(m.parameters(), lr=0.05)

    with pytest.raises(ResumeRefused, match='resume="auto"'):
        watch(*fresh(), checkpoint_dir=ckpt)
    with caplog.at_level(logging.WARNING):
        again = watch(*fresh(), checkpoint_dir=ckpt, resume="auto")
    assert again.resumed_from == 4 and "resumed from" in caplog.text and "step 4" in caplog.text
    again.close()
    monkeypatch.setenv("TORCHVITALS_SUPERVISOR_ATTEMPT", "2")  # a supervised restart
    restarted = watch(*fresh(), checkpoint_dir=ckpt)
    assert restarted.resumed_from == 4
    restarted.close()


def test_the_abort_says_why_and_no_step_follows_it(tmp_path, caplog):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = watch(
        model,
        opt,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=2,
        healthy_window=0,
        max_rollbacks=1,
    )
    with caplog.at_level(logging.WARNING), pytest.raises(torchvitals.TrainingAborted) as aborted:
        for s in range(20):
            loss = loss_of(model, s) * (float("nan") if s >= 5 else 1.0)
            loss.backward()
            try:
                agent.step(loss)
            finally:
                opt.zero_grad()
    assert aborted.value.code == 75
    assert (
        "ABORTING" in caplog.text and "Exit code 75" in caplog.text and "ledger.json" in caplog.text
    )
    loss_of(model, 0).backward()
    with pytest.raises(torchvitals.TrainingAborted):  # swallowing it does not train on
        opt.step()
    agent.close()


def test_healthy_means_no_warning_active_not_only_none_recent():
    import tempfile

    from torchvitals.agent.config import Config
    from torchvitals.agent.detect.detector import Detector
    from torchvitals.agent.detect.verdict import HOT_LR, WARNING, Verdict
    from torchvitals.agent.recover.watchdog import Watchdog

    with tempfile.TemporaryDirectory() as root:
        dog = Watchdog.open(Config(checkpoint_dir=root, healthy_window=5))
        detector = Detector(["a", "b"], ["layer", "layer"])
        assert dog.healthy(100, detector)
        hot = Verdict(HOT_LR, WARNING, 10, "a")
        detector.active[(HOT_LR, "a", None)] = hot  # raised at step 10, still holding at 100
        assert not dog.healthy(100, detector)
        detector.pinned.add((HOT_LR, "a", None))  # a wiring fact does not count
        assert dog.healthy(100, detector)
