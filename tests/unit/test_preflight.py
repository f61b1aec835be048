"""Unit tests for the preflight checks on real small models.

python -m pytest tests/unit/test_preflight.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from support import preflight_factories as factories
from support.models import TinyGPT
from torch import nn

from torchvitals.__main__ import main
from torchvitals.agent.detect import CRITICAL
from torchvitals.agent.tools.preflight import (
    Finding,
    lr_range_test,
    memorization_test,
    preflight,
    wiring_checks,
)


def bn_dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4)
    )


def test_healthy_mlp_memorizes():
    setup = factories.healthy()
    result = memorization_test(setup["model"], setup["loss_fn"], setup["batch"])
    assert result.passed, result.reason
    assert result.final_loss <= 1e-2 * result.initial_loss and result.steps < 300
    assert result.reason.startswith("loss ")


def test_healthy_tinygpt_memorizes():
    g = torch.Generator().manual_seed(0)
    # Distinct first tokens: the next-token labels are consistent, so zero loss is reachable.
    start = torch.randperm(64, generator=g)[:12, None]
    seq = (start + torch.randint(1, 4, (12, 1), generator=g) * torch.arange(9)) % 64
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=8)
    result = memorization_test(model, lambda m, b: m.loss(*b), (seq[:, :-1], seq[:, 1:]))
    assert result.passed, result.reason
    assert result.final_loss <= 1e-2 * result.initial_loss


def test_detached_output_fails_with_no_gradient():
    setup = factories.detached()
    result = memorization_test(setup["model"], setup["loss_fn"], setup["batch"])
    assert not result.passed
    assert result.reason.startswith("no gradient") and "detached" in result.reason
    assert result.steps == 10  # stopped early: nothing can move without a gradient
    assert result.final_loss == result.initial_loss


def test_loss_without_grad_fails_with_no_gradient():
    setup = factories.healthy()
    result = memorization_test(
        setup["model"], lambda m, b: setup["loss_fn"](m, b).detach(), setup["batch"]
    )
    assert not result.passed and result.reason.startswith("no gradient") and result.steps == 1


def test_a_block_without_gradient_is_named():
    setup = factories.healthy()
    model = setup["model"]
    model.layers[4].requires_grad_(False)  # the head is frozen: the rest still trains
    result = memorization_test(model, setup["loss_fn"], setup["batch"], steps=10)
    assert not result.passed
    assert "layers.4 get no gradient" in result.reason and "dead_layer" in result.reason


def test_lr_range_test_finds_the_boundary_and_plots(tmp_path):
    setup = factories.healthy()
    png = tmp_path / "lr.png"
    torch.manual_seed(1)
    result = lr_range_test(
        factories.MLP, setup["loss_fn"], setup["batches"], steps=60, png=str(png)
    )
    assert result.boundary_lr is not None and 1e-6 < result.boundary_lr < 1.0
    assert result.suggested_lr == pytest.approx(result.boundary_lr / 10)
    assert result.passed and len(result.lrs) < 60  # the sweep stops at the boundary
    assert result.smoothed[-1] > min(result.smoothed)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_wiring_finds_nothing_on_a_correct_setup():
    model = bn_dropout_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def evaluate(m):
        m.eval()
        with torch.no_grad():
            m(torch.randn(8, 10))
        m.train()

    assert wiring_checks(model, optimizer, evaluate) == []


def test_wiring_catches_frozen_and_missing_parameters():
    model = bn_dropout_model()
    model[0].weight.requires_grad_(False)
    optimizer = torch.optim.SGD(model[4].parameters(), lr=0.1)
    findings = wiring_checks(model, optimizer)
    assert (
        Finding(
            "frozen_parameters",
            "0",
            "weight have requires_grad=False: intended (fine-tuning) or forgotten after a freeze?",
            "warning",
        )
        in findings
    )
    missing = {f.subject: f for f in findings if f.check == "not_in_optimizer"}
    assert set(missing) == {"0", "1"} and all(f.severity == CRITICAL for f in missing.values())
    assert missing["0"].message.startswith(
        "bias are trainable"
    )  # the frozen weight is not "missing"


def test_wiring_catches_an_evaluation_in_training_mode():
    model = bn_dropout_model()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(16, 10)
    outputs = []

    def forgetful_evaluate(m):
        with torch.no_grad():
            outputs.extend([m(x), m(x)])

    findings = wiring_checks(model, torch.optim.SGD(model.parameters(), lr=0.1), forgetful_evaluate)
    assert not torch.equal(*outputs)  # the bug is real: dropout made evaluation random
    assert {(f.check, f.subject) for f in findings} == {
        ("dropout_active_in_eval", "3"),
        ("batchnorm_train_in_eval", "1"),
    }
    # The check undoes the damage: running stats and train/eval flags are as before.
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and model.training


def test_wiring_notes_grad_on_and_a_model_left_in_eval():
    model = bn_dropout_model()
    findings = wiring_checks(model, None, lambda m: m.eval()(torch.randn(4, 10)))
    assert {f.check: f.severity for f in findings} == {
        "grad_enabled_in_eval": "info",
        "left_in_eval": "warning",
    }
    assert model.training


def test_preflight_report(tmp_path):
    report = preflight(**factories.healthy(), steps=200, lr_steps=40, png=str(tmp_path / "lr.png"))
    assert report.passed, report.render()
    text = report.render()
    assert text.splitlines()[0] == "preflight: PASSED" and "wiring: no findings" in text
    broken = preflight(**factories.detached(), steps=200, lr_steps=20)
    assert not broken.passed and "memorization: FAIL: no gradient" in broken.render()


def test_preflight_leaves_the_model_untouched():
    setup = factories.healthy()
    before = copy.deepcopy(setup["model"].state_dict())
    optimizer = torch.optim.SGD(setup["model"].parameters(), lr=0.5, momentum=0.9)
    report = preflight(
        setup["model"], setup["loss_fn"], setup["batch"], optimizer=optimizer, steps=20, lr_steps=10
    )
    after = setup["model"].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert report.memorization.steps <= 20 and not optimizer.state  # the instance was not stepped


def test_cli_preflight_failures(capsys, monkeypatch):
    monkeypatch.setenv("TORCHVITALS_PREFLIGHT_LR_STEPS", "20")
    assert main(["preflight", "support.preflight_factories:detached", "--steps", "50"]) == 1
    assert "no gradient" in capsys.readouterr().out
    for spec, error in (
        ("support.preflight_factories:incomplete", "ValueError"),
        ("no_such_module:f", "ModuleNotFound"),
        ("support.preflight_factories", "ValueError"),
        ("support.preflight_factories:nope", "AttributeError"),
    ):
        assert main(["preflight", spec]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"torchvitals preflight: {error}") and err.count("\n") == 1
