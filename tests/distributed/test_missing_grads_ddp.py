"""Under DDP (unused parameters allowed, 2 gloo ranks), a layer left out of the forward pass has
no gradient on any rank: both ranks report it as missing, from the same reduced counts (the
blocks are split between the ranks, so only one rank reads each), rank 0 says so once, and the
other blocks stay exact."""

from __future__ import annotations

import math

import pytest
from support.bypass import LAYER, block_norm, ddp_bypass
from support.world import run_world

MISSING = f"layers.{LAYER}"


@pytest.mark.parametrize("mode", ["bypass", "zeroed"])
def test_a_layer_no_rank_has_a_gradient_of_is_missing_on_every_rank(mode):
    steps = 8
    ranks = run_world(ddp_bypass, mode, steps, timeout=180)
    # Every field kept is a global one: bit-identical on both ranks (repr: NaN equals NaN).
    assert repr(ranks[0]["reports"]) == repr(ranks[1]["reports"])
    for report, ref in zip(ranks[0]["reports"], ranks[0]["ref"]):
        if mode == "bypass":
            assert report["missing"] == [MISSING] and math.isnan(report["grad_norm"][MISSING])
        else:  # present and exactly zero: measured
            assert report["missing"] == [] and report["grad_norm"][MISSING] == 0.0
        for block in ("layers.1", "layers.2", "layers.3", "out"):
            assert report["grad_norm"][block] == pytest.approx(block_norm(ref, block), rel=1e-6)
    warned = [len(r["warnings"]) for r in ranks]
    assert warned == ([1, 0] if mode == "bypass" else [0, 0]), warned
    history = {p for p, _, _ in ranks[0]["history"]}
    assert ("vanishing_gradients" in history) == (mode == "zeroed"), history
    assert "dead_pipeline" not in history
