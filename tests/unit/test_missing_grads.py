"""Where no rank could read a block's gradient, the block is reported as missing (NaN, named in
``grad_norm_missing``, said once), never as a 0 that reads as a dead layer; a block whose
gradient is present and exactly zero, a frozen block and a detached graph are judged as before."""

from __future__ import annotations

import io
import math

import pytest
import torch
from prometheus_client import CollectorRegistry
from support.bypass import LAYER, Bypass, block_norm, train

import torchvitals
from torchvitals.agent.detect import Detector
from torchvitals.agent.measure.blocks import HEAD, OTHER
from torchvitals.agent.measure.blocks import LAYER as LAYER_KIND
from torchvitals.agent.outputs.exporter import Exporter
from torchvitals.agent.outputs.live import LiveView
from torchvitals.agent.report import Report
from torchvitals.agent.signals.grads import unread_blocks

MISSING = f"layers.{LAYER}"
GRAD_PATTERNS = {
    "vanishing_gradients",
    "dead_pipeline",
    "nonfinite_grad",
    "layer_divergence",
    "grad_explosion",
}


def test_unread_blocks():
    # Read on some rank: measured. Not read anywhere while others were: missing.
    assert unread_blocks([2.0, 0.0, 1.0], [True, True, True], partitioned=False) == [1]
    # A frozen block (or one no optimizer steps) has no gradient by design: not missing.
    assert unread_blocks([2.0, 0.0, 1.0], [True, False, True], partitioned=False) == []
    # Nothing at all in param.grad: the backward pass reached no parameter, a zero gradient.
    assert unread_blocks([0.0, 0.0], [True, True], partitioned=False) == []
    # Nothing in a framework's partitions: they are somewhere torchvitals does not read.
    assert unread_blocks([0.0, 0.0], [True, True], partitioned=True) == [0, 1]


def test_a_bypassed_layer_is_missing_said_once_and_never_judged_from_its_gradient():
    model = Bypass("bypass")
    run = train(model, model, 12, seed=0, sample_every=5)
    assert run["blocks"][LAYER] == MISSING
    for report, ref in zip(run["reports"], run["ref"]):
        assert report["missing"] == [MISSING]
        assert math.isnan(report["grad_norm"][MISSING])
        measured = [b for b in run["blocks"] if b != MISSING and b != OTHER]
        for block in measured:
            assert report["grad_norm"][block] == pytest.approx(block_norm(ref, block), rel=1e-6)
        total = math.sqrt(sum(v or 0.0 for v in ref.values()))
        assert report["total"] == pytest.approx(total, rel=1e-6) and report["action"] == "step"
    assert len(run["warnings"]) == 1 and MISSING in run["warnings"][0], run["warnings"]
    # Its gradient raises nothing (a 0 there used to read as vanishing: last/first = inf). Its
    # update ratio is measured, and exactly 0 (AdamW leaves a parameter without gradient
    # alone) while the others move: that dead_layer is the measured truth.
    assert not {p for p, _, _ in run["history"]} & GRAD_PATTERNS, run["history"]
    assert {(p, b, f) for p, b, f in run["history"]} <= {("dead_layer", MISSING, "dead_ratio")}
    assert [r["update_ratio"][MISSING] for r in run["reports"] if r["update_ratio"]] == [0.0, 0.0]


def test_without_the_update_ratio_a_bypassed_layer_raises_no_verdict():
    model = Bypass("bypass")
    run = train(model, model, 12, seed=0, update_ratio=False)
    assert all(r["missing"] == [MISSING] for r in run["reports"])
    assert run["history"] == []


def test_a_layer_whose_gradient_is_exactly_zero_is_measured_and_still_vanishing():
    model = Bypass("zeroed")
    run = train(model, model, 12, seed=0, sample_every=5)
    assert all(r["missing"] == [] and r["grad_norm"][MISSING] == 0.0 for r in run["reports"])
    assert run["warnings"] == []
    assert ("vanishing_gradients", MISSING, "vanishing_ratio") in run["history"]


def test_a_frozen_layer_is_not_missing():
    model = Bypass("none")
    model.layers[LAYER].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with torchvitals.watch(model, opt, metrics_port=0, log_dir="") as agent:
        x, y = torch.randn(32, 8), torch.randn(32, 1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        report = agent.step()
        assert report.grad_norm[MISSING] == 0.0 and report.grad_norm_missing == []
        assert ("dead_layer", MISSING) in [(v.pattern, v.block) for v in agent.detector.history]


def _report(step: int, norms: dict[str, float], missing: list[str]) -> Report:
    measured = [v for b, v in norms.items() if b not in missing]
    total = math.sqrt(sum(v * v for v in measured)) if measured else math.nan
    return Report(
        step=step, loss=2.0, grad_norm=norms, grad_norm_total=total, grad_norm_missing=missing
    )


def test_the_rules_judge_nothing_from_a_missing_norm():
    names, kinds = ["layers.0", "layers.1", "layers.2", "out"], [LAYER_KIND] * 3 + [HEAD]
    detector = Detector(names, kinds)
    fired = []
    for step in range(1, 30):
        norms = {"layers.0": math.nan, "layers.1": 0.5, "layers.2": 0.6, "out": 1.0}
        fired += detector.observe(_report(step, norms, ["layers.0"]), None)
    everything = Detector(names, kinds)  # nothing readable at all: no norm, no verdict
    for step in range(1, 30):
        fired += everything.observe(_report(step, dict.fromkeys(names, math.nan), names), None)
    assert fired == []
    # The control: the same first layer measured at exactly 0 is vanishing.
    control = Detector(names, kinds)
    found = []
    for step in range(1, 10):
        found += control.observe(
            _report(step, {"layers.0": 0.0, "layers.1": 0.5, "layers.2": 0.6, "out": 1.0}, []), None
        )
    assert "vanishing_gradients" in [v.pattern for v in found]


def test_a_missing_norm_is_exported_as_nan_and_the_views_take_it():
    ex = Exporter(
        ["a", "b"], rank=0, local_rank=0, world_size=1, port=0, registry=CollectorRegistry()
    )
    try:
        ex.update(_report(1, {"a": math.nan, "b": 0.5}, ["a"]))
        got = {
            s.labels["block"]: s.value
            for f in ex.registry.collect()
            if f.name == "torchvitals_grad_norm"
            for s in f.samples
        }
        total = [
            s.value
            for f in ex.registry.collect()
            if f.name == "torchvitals_grad_norm_global"
            for s in f.samples
        ]
    finally:
        ex.close()
    assert math.isnan(got["a"]) and got["b"] == 0.5 and total == [0.5]
    event = _report(1, {"a": math.nan, "b": 0.5}, ["a"]).to_dict()
    assert event["grad_norm"] == {"a": "nan", "b": 0.5} and event["grad_norm_missing"] == ["a"]
    for terminal in (False, True):
        stream = io.StringIO()
        view = LiveView(["a", "b"], stream=stream, terminal=terminal, every=1)
        for step in range(1, 4):
            view.update(_report(step, {"a": math.nan, "b": 0.5}, ["a"]))
            view.update(_report(step, dict.fromkeys("ab", math.nan), ["a", "b"]))
        view.close()
        assert stream.getvalue()  # drawn, not raised
