"""fp16 with a GradScaler, reproduced on the CPU (float16 autocast, a scale that overflows):
the loop that hands its scaler to ``agent.step`` and the loop that steps through it itself.

    python -m pytest tests/scenarios/test_scenarios_fp16.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_scenarios_more import fired, mlp, regression, train

import torchvitals

# ---------------------------------------------------------------- fp16 overflow


@pytest.mark.parametrize("init_scale", [2.0**30, 2.0**18])
def test_fp16_scaler_overflow_skips_and_halves(init_scale):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    x, y = regression(512)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 512, 32)] * 2
    changed = []

    def fp16_loss(batch):
        changed.append([p.detach().clone() for p in model.parameters()])
        with torch.autocast("cpu", dtype=torch.float16):
            return F.mse_loss(model(batch[0]), batch[1])

    def after(report):
        changed[-1] = any(not torch.equal(a, p) for a, p in zip(changed[-1], model.parameters()))

    with torchvitals.watch(model, opt) as agent:
        reports = train(agent, opt, batches, fp16_loss, scaler=scaler, on_step=after)
        verdicts = [v for v in agent.detector.history if v.pattern == "fp16_overflow"]
        history = fired(agent)
    overflowed = [r.step for r in reports if r.overflow]
    for r, nxt, moved in zip(reports, [*reports[1:], None], changed):
        assert r.loss_scale is not None and not r.nonfinite_loss
        if r.overflow:
            assert r.action == "skip" and not moved and r.nonfinite_grad
        else:
            assert r.action == "step" and moved
        if nxt is not None:
            assert nxt.loss_scale == (r.loss_scale / 2 if r.overflow else r.loss_scale)
    assert "nonfinite_grad" not in {p for p, _, _ in history}, "an overflow is not a NaN failure"
    if init_scale < 2.0**30:
        # One overflow (2^18 -> 2^17 at step 13) is the scaler doing its job: quiet.
        assert len(overflowed) == 1 and verdicts == [], (overflowed, history)
        return
    # 2^30 backs off to 2^19 over the first 11 steps, then more as the loss moves (2^17 today).
    assert overflowed[:11] == list(range(1, 12)) and len(overflowed) >= 12, overflowed
    assert scaler.get_scale() == init_scale / 2 ** len(overflowed)
    assert [(v.step, v.block) for v in verdicts] == [(3, None)], history
    assert verdicts[0].evidence["skipped_steps"] == [1, 2, 3]
    assert verdicts[0].evidence["scales"] == [2.0**30, 2.0**29, 2.0**28]
    assert sum(r.action == "step" for r in reports) == len(reports) - len(overflowed)
    assert history == [("fp16_overflow", None, 3)]


def _scaler_loop(watched: bool):
    """nanoGPT's fp16 loop: scale, backward, unscale, clip, ``scaler.step``, ``scaler.update``;
    with torchvitals or without (the reference). Returns (scales, params, reports, history)."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    agent = torchvitals.watch(model, opt) if watched else None
    x, y = regression(512)
    scales, reports = [], []
    for i in range(0, 512, 32):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x[i : i + 32]), y[i : i + 32])
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scales.append(scaler.get_scale())
        if agent is not None:
            agent.record_loss(loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if agent is not None and agent.last_report is not None and agent.last_report not in reports:
            reports.append(agent.last_report)
    history = fired(agent) if agent is not None else []
    if agent is not None:
        agent.close()
    return scales, [p.detach().clone() for p in model.parameters()], reports, history


def test_a_loop_stepping_through_its_own_scaler_shows_every_overflow_and_trains_as_without():
    ref_scales, ref_params, _, _ = _scaler_loop(False)
    scales, params, reports, history = _scaler_loop(True)
    # Not a bit of the training changes: the same scales, backed off at the same steps, and
    # the same weights as the loop without torchvitals.
    assert scales == ref_scales
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    # Every scaler.step reached the agent, overflow steps too (2^30 needs 11 halvings).
    assert [r.step for r in reports] == list(range(1, 17))
    overflowed = [r.step for r in reports if r.overflow]
    assert overflowed[:11] == list(range(1, 12)), overflowed
    assert all(r.action == "skip" for r in reports if r.overflow)
    assert all(r.action == "step" for r in reports if not r.overflow)
    assert [r.loss_scale for r in reports] == scales
    assert all(math.isfinite(r.loss) for r in reports), "the unscaled fp16 loss, not an Inf"
    assert history == [("fp16_overflow", None, 3)], "an overflow is not a NaN failure"
