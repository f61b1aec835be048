"""A user's own signal, rule and sink work through ``watch(signals=, rules=, sinks=)`` alone: the
example's parameter-norm signal against a norm computed here, its rule on a runaway and on a
healthy run, the TensorBoard sink's event file read back, and a sink that raises."""

from __future__ import annotations

import ast
import inspect
import logging
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import torchvitals
from torchvitals.agent.tools.demo.data import random_batches
from torchvitals.agent.tools.demo.model import TinyGPT
from torchvitals.agent.tools.examples import custom_vitals
from torchvitals.agent.tools.examples.custom_vitals import (
    PARAM_NORM,
    PARAM_NORM_GROWTH,
    ParamNorm,
    ParamNormGrowth,
    TensorBoardSink,
)

QUIET = {"log_dir": "", "metrics_port": 0}


def _model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab=32, d_model=32, n_layers=1, seq_len=16)


def _train(steps: int, *, hot_from: int | None = None, sinks=(), **watch):
    """Train the tiny GPT with the example's signal and rule; the reports and the norms
    computed here just before each step (what the signal measures)."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    agent = torchvitals.watch(
        model,
        optimizer,
        signals=[ParamNorm(model)],
        rules=[ParamNormGrowth(window=10, growth=1.2)],
        sinks=list(sinks),
        **{**QUIET, **watch},
    )
    reports, norms = [], []
    try:
        for i, (x, y) in enumerate(random_batches(steps, batch=4, seq_len=16, vocab=32)):
            if hot_from is not None and i + 1 == hot_from:
                for group in optimizer.param_groups:
                    group["lr"] *= 100
            loss = model.loss(x, y)
            loss.backward()
            with torch.no_grad():
                norms.append(
                    math.sqrt(sum(float(p.double().pow(2).sum()) for p in model.parameters()))
                )
            reports.append(agent.step(loss))
            optimizer.zero_grad(set_to_none=True)
    finally:
        agent.close()
    return agent, reports, norms


def _found(reports, pattern):
    return [v for r in reports for v in r.verdicts if v.pattern == pattern]


def test_the_signal_is_the_parameters_global_norm_every_step():
    _, reports, norms = _train(12)
    assert [r.custom[PARAM_NORM] for r in reports] == pytest.approx(norms, rel=1e-12)


def test_the_rule_warns_when_the_weights_run_away_and_not_on_a_healthy_run():
    _, healthy, norms = _train(40)
    assert norms[-1] / norms[0] < 1.05  # the healthy run really is steady
    assert not _found(healthy, PARAM_NORM_GROWTH)
    _, hot, norms = _train(40, hot_from=15)
    found = _found(hot, PARAM_NORM_GROWTH)
    assert found, [round(n, 1) for n in norms]
    first = found[0]
    assert first.severity == torchvitals.WARNING and first.step > 15
    assert first.evidence["ratio"] > 1.2
    i = first.step - 1
    assert norms[i] / norms[i - 10] == pytest.approx(first.evidence["ratio"], rel=1e-9)
    # A warning is emitted once when it becomes active, not every step it holds.
    assert len(found) < sum(1 for r in hot if r.step > first.step) + 1


def test_the_tensorboard_sink_writes_the_loss_the_grad_norms_and_the_signal(tmp_path):
    _, reports, _ = _train(6, sinks=[TensorBoardSink(str(tmp_path))])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    blocks = list(reports[0].grad_norm)
    assert {"loss", "grad_norm_total", f"custom/{PARAM_NORM}", "lr/0"} <= tags
    assert {f"grad_norm/{b}" for b in blocks} <= tags

    def series(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert series("loss") == [(r.step, pytest.approx(r.loss, rel=1e-6)) for r in reports]
    assert series(f"custom/{PARAM_NORM}") == [
        (r.step, pytest.approx(r.custom[PARAM_NORM], rel=1e-6)) for r in reports
    ]
    assert series(f"grad_norm/{blocks[-1]}") == [
        (r.step, pytest.approx(r.grad_norm[blocks[-1]], rel=1e-6)) for r in reports
    ]


class Broken(torchvitals.Sink):
    def __init__(self):
        self.calls = 0

    def publish(self, report):
        self.calls += 1
        raise OSError("disk full")


def test_a_sink_that_raises_never_stops_the_training(caplog):
    broken = Broken()
    with caplog.at_level(logging.WARNING, logger="torchvitals"):
        agent, reports, _ = _train(5, sinks=[broken])
    assert [r.step for r in reports] == [1, 2, 3, 4, 5] and broken.calls == 5
    assert agent.outputs.failures == {"Broken": 5}
    assert sum("Broken failed" in r.getMessage() for r in caplog.records) == 1


def test_what_is_not_a_signal_rule_or_sink_is_refused_at_watch():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in ({"signals": [object()]}, {"rules": [object()]}, {"sinks": [object()]}):
        with pytest.raises(TypeError, match="torchvitals"):
            torchvitals.watch(model, optimizer, **bad, **QUIET)
    torchvitals.watch(model, optimizer, **QUIET).close()  # nothing was left behind


def test_a_user_signal_adds_its_floats_to_the_steps_one_sum():
    """No collective of its own: one more float in the SUM the step reduces anyway."""
    lengths = {}
    for signals in ((), (ParamNorm,)):
        model = _model()
        agent = torchvitals.watch(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            signals=[s(model) for s in signals],
            **QUIET,
        )
        seen: list[tuple[int, int]] = []

        def recording(packer, reduce=agent._reducer.reduce, seen=seen):
            reduced = reduce(packer)
            seen.append((reduced.sum_len, reduced.max_len))
            return reduced

        agent._reducer.reduce = recording
        x, y = next(iter(random_batches(1, batch=4, seq_len=16, vocab=32)))
        model.loss(x, y).backward()
        agent.step()
        agent.close()
        lengths[signals] = seen[0]
    (sum_without, max_without), (sum_with, max_with) = lengths[()], lengths[(ParamNorm,)]
    assert sum_with == sum_without + 1 and max_with == max_without


def test_the_example_uses_only_the_names_torchvitals_exports():
    """Written as a user would: ``import torchvitals`` and its public names, nothing inside."""
    tree = ast.parse(inspect.getsource(custom_vitals))
    imported = {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name.startswith("torchvitals")
    } | {
        n.module or "."
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("torchvitals"))
    }
    assert imported == {"torchvitals"}, imported
    used = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "torchvitals"
    }
    assert used and used <= set(torchvitals.__all__), used - set(torchvitals.__all__)
