"""Single process, float32: every signal equals an independent float64 reference to rtol 1e-5."""

import copy

import torch
from support.models import TINY, TINY_BLOCKS, TinyGPT, random_batches
from support.reference import (
    OutputRecorder,
    assert_activations,
    assert_close,
    ref_grad_norms,
    ref_update_ratios,
    snapshot,
)
from torch import nn

import torchvitals

ACT_BLOCKS = [b for b in TINY_BLOCKS if b != "other"]


def _batches(n, batch=4):
    return list(random_batches(n, batch=batch, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))


def test_block_names_follow_the_model():
    model = TinyGPT(**TINY)
    agent = torchvitals.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert agent.block_names == TINY_BLOCKS
    agent.close()


def test_grad_norms_update_ratios_and_activations_match_reference():
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    agent = torchvitals.watch(model, opt, sample_every=2)
    checked_updates = checked_acts = 0
    expected_update: dict = {}
    for step, (x, y) in enumerate(_batches(7), start=1):
        sampled = step == 1 or step % 2 == 0
        recorder = OutputRecorder(reference, ACT_BLOCKS) if sampled else None
        ref_loss = reference.loss(x, y)
        ref_loss.backward()
        ref_loss = ref_loss.detach()
        expected_norms, expected_total = ref_grad_norms(reference, TINY_BLOCKS[:-1])
        loss = model.loss(x, y)
        loss.backward()
        report = agent.step(loss)
        assert report.action == "step" and not report.nonfinite
        assert_close(report.loss, ref_loss.item(), what="loss")
        assert set(report.grad_norm) == set(expected_norms)
        for block, value in expected_norms.items():
            assert_close(report.grad_norm[block], value, what=f"step {step} grad_norm[{block}]")
        assert_close(report.grad_norm_total, expected_total, what="grad_norm_total")
        if sampled:
            for block in ACT_BLOCKS:
                expected = recorder.stats()[block]
                assert_activations(report.activations[block], expected, f"step {step} {block}")
            recorder.close()
            checked_acts += 1
        else:
            assert report.activations == {}
        if report.update_ratio:
            assert report.update_ratio_step == step - 1
            for block, value in expected_update.items():
                assert_close(report.update_ratio[block], value, what=f"update_ratio[{block}]")
            checked_updates += 1
        before = snapshot(reference)
        ref_opt.step()
        expected_update = ref_update_ratios(before, snapshot(reference), TINY_BLOCKS[:-1])
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
    assert checked_updates == 3 and checked_acts == 4
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), f"the agent changed the training of {n}"
    agent.close()


def test_gradient_accumulation_counts_every_micro_batch():
    torch.manual_seed(1)
    model = TinyGPT(**TINY)
    reference = copy.deepcopy(model)
    agent = torchvitals.watch(model, torch.optim.SGD(model.parameters(), lr=0.01))
    recorder = OutputRecorder(reference, ACT_BLOCKS)
    micro = _batches(3)
    for x, y in micro:
        (reference.loss(x, y) / 3).backward()
        (model.loss(x, y) / 3).backward()
    _expected_norms, total = ref_grad_norms(reference, TINY_BLOCKS[:-1])
    report = agent.step(torch.tensor(1.0))
    assert_close(report.grad_norm_total, total, what="total")
    for block in ACT_BLOCKS:
        assert_activations(report.activations[block], recorder.stats()[block], block)
    agent.close()


def test_eval_forward_is_not_recorded():
    model = TinyGPT(**TINY)
    reference = copy.deepcopy(model)
    agent = torchvitals.watch(model, torch.optim.SGD(model.parameters(), lr=0.01))
    (x, y), (x_val, y_val) = _batches(2)
    model.eval()
    with torch.no_grad():
        model.loss(x_val, y_val)
    model.train()
    recorder = OutputRecorder(reference, ACT_BLOCKS)
    reference.loss(x, y)
    report = agent.step(model.loss(x, y).detach())
    for block in ACT_BLOCKS:
        assert_activations(report.activations[block], recorder.stats()[block], block)
    agent.close()


def test_frozen_and_unused_parameters_report_zero():
    torch.manual_seed(2)
    model = TinyGPT(**TINY)
    model.blocks[1].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    agent = torchvitals.watch(model, opt, sample_every=1)
    for x, y in _batches(2):
        model.loss(x, y).backward()
        report = agent.step(torch.tensor(0.0))
        opt.zero_grad()
    assert report.grad_norm["blocks.1"] == 0.0
    assert report.update_ratio["blocks.1"] == 0.0
    assert report.update_ratio["blocks.0"] > 0
    agent.close()


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(3)
    model = TinyGPT(**TINY)
    reference = copy.deepcopy(model)
    agent = torchvitals.watch(
        model, torch.optim.SGD(model.parameters(), lr=0.1), clip_grad_norm=0.05
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ((x, y),) = _batches(1)
    model.loss(x, y).backward()
    reference.loss(x, y).backward()
    total = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
    ref_opt.step()
    report = agent.step(torch.tensor(0.0))
    assert_close(report.grad_norm_total, total, what="pre-clip total")
    assert report.clip_coef < 1
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    agent.close()


def test_nonfinite_loss_skips_the_optimizer_step():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    agent = torchvitals.watch(model, opt, sched)
    before = copy.deepcopy(model.state_dict())
    loss = model(torch.randn(3, 4)).sum() * float("nan")
    loss.backward()
    report = agent.step(loss)
    assert report.nonfinite and report.nonfinite_loss and report.nonfinite_grad
    assert report.action == "skip"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 0.1
    agent.close()


def test_tanh_mlp_blocks_measure_after_the_activation():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.mul_(50)
    agent = torchvitals.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert agent.block_names == ["0", "2", "4"]
    loss = model(torch.randn(64, 4)).pow(2).mean()
    loss.backward()
    report = agent.step(loss)
    assert 0 < report.activations["0"]["saturation_fraction"] <= 1
    assert report.activations["0"]["abs_max"] <= 1.0
    agent.close()


def test_nonfinite_activations_are_counted_exactly():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    recorder = OutputRecorder(model, ["1", "2"])
    agent = torchvitals.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(16, 4)
    x[3, 0], x[7, 2] = float("inf"), float("nan")
    loss = model(x).sum()
    loss.backward()
    report = agent.step(loss)
    expected = recorder.stats()
    for block, path in (("0", "1"), ("2", "2")):
        assert expected[path]["nonfinite"] > 0
        assert report.activations[block]["nonfinite"] == expected[path]["nonfinite"]
    assert report.action == "skip" and report.nonfinite_loss
    agent.close()
