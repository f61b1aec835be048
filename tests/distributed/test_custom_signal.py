"""A user's signal (the example's parameter norm) rides the step's one SUM across two gloo ranks:
its value is the reference computed from both ranks' weights, identical on both, it adds no
collective, and ranks given different signals fail at watch() on every rank, with the same
error."""

from __future__ import annotations

import math

import pytest
from custom_signal_ranks import mismatched, replicated, sharded
from support.world import run_world

STEPS = 4


def test_a_user_signal_is_the_sum_over_the_ranks():
    ranks = run_world(sharded, STEPS, timeout=180)
    reference = [math.sqrt(a + b) for a, b in zip(ranks[0]["mine"], ranks[1]["mine"])]
    assert ranks[0]["mine"] != ranks[1]["mine"]  # each rank really holds different weights
    assert ranks[0]["reported"] == ranks[1]["reported"]  # bit-identical on every rank
    assert ranks[0]["reported"] == pytest.approx(reference, rel=1e-12)


def test_ddp_replicas_report_their_own_norm_with_no_extra_collective():
    ranks = run_world(replicated, STEPS, timeout=180)
    for rank in ranks:
        assert rank["with"]["reported"] == pytest.approx(
            [math.sqrt(s) for s in rank["with"]["mine"]], rel=1e-12
        )
        assert rank["with"]["collectives"] == rank["without"]["collectives"]


def test_ranks_given_different_signals_fail_at_watch_on_every_rank():
    messages = run_world(mismatched, timeout=120)
    assert messages[0] == messages[1], messages  # the same error on every rank
    kind, text = messages[0]
    assert kind == "SettingsDifferError", messages
    # It names what differs, and which rank packs which signals.
    assert "signals:" in text and "ParamNorm on rank 0" in text, text
    assert "on rank 1" in text and "watch(signals=...)" in text, text
