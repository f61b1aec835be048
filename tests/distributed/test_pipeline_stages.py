"""Ranks that hold different parts of one model (pipeline stages, a loss on the last stage
only) agree on one layout: every block of every stage, each measured exactly by the ranks that
hold it, the loss the last stage's, the same decision on every rank."""

from __future__ import annotations

import math

import pytest
from stage_ranks import STEPS, two_stages
from support.world import run_world


def test_two_stages_report_every_block_exactly_and_decide_together():
    fault = 4
    ranks = run_world(two_stages, fault, timeout=180)
    names = ["emb", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    for rank in ranks:
        assert rank["blocks"] == names
        assert rank["kinds"] == ["embedding", "layer", "layer", "layer", "layer", "head"]
    a, b = ranks[0]["reports"], ranks[1]["reports"]
    assert [(r["action"], r["verdicts"]) for r in a] == [(r["action"], r["verdicts"]) for r in b]
    assert [r["action"] for r in a] == ["step"] * (fault - 1) + ["skip"] + ["step"] * (
        STEPS - fault
    )
    assert "nonfinite_loss" in a[fault - 1]["verdicts"]
    for i in range(STEPS):
        if i == fault - 1:
            continue
        for rank_reports in (a, b):  # the last stage's loss, on both ranks
            assert rank_reports[i]["loss"] == pytest.approx(b[i]["local_loss"], rel=1e-12)
        # each block's norm: the one rank that holds it measured it; both report it
        held = {**ranks[0]["norms"][i], **ranks[1]["norms"][i]}
        assert set(held) == set(names)
        for name in names:
            assert a[i]["grad_norm"][name] == pytest.approx(held[name], rel=1e-6), (i, name)
            assert b[i]["grad_norm"][name] == a[i]["grad_norm"][name]
            assert held[name] > 0 and math.isfinite(held[name])
        assert a[i]["verdicts"] == []
