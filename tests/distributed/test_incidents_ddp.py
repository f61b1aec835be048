"""A NaN loss on one of two gloo ranks under DDP: every rank rolls back at that step, and exactly
one incident names rank 1 (its node, host and pid) at that step, written within the step; the
step's SUM payload is as long at world size 2 as at 1 (the culprit rides three summed floats),
but for a sampled step's three floats naming a rank whose activations were far out."""

from __future__ import annotations

import json

import pytest
from nan_incident_ranks import nan_on_rank1
from support.world import run_world

from torchvitals.records.incidents import IncidentLog

NAN_STEP, STEPS = 12, 16


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("nan-ddp")
    return root, run_world(nan_on_rank1, str(root), NAN_STEP, STEPS, timeout=240)


def test_every_rank_rolls_back_at_the_nan_step_and_knows_rank_1_did_it(job):
    _, ranks = job
    for rank in ranks:
        at = [a for a in rank["actions"] if a[0] == NAN_STEP]
        assert at[0] == (NAN_STEP, "rollback", [1]), rank["actions"]
        assert all(a[1] in ("step", "rollback") for a in rank["actions"])
    assert ranks[0]["actions"] == ranks[1]["actions"]


def test_exactly_one_incident_names_rank_1_at_that_step_written_within_it(job):
    root, ranks = job
    incidents, problems = IncidentLog(root).read()
    assert not problems and len(incidents) == 1, [i.line() for i in incidents]
    (incident,) = incidents
    print("\n" + json.dumps(incident.to_dict(), indent=1))
    assert (incident.kind, incident.step) == ("nonfinite", NAN_STEP)
    culprit = incident.culprit
    assert (culprit.rank, culprit.node) == (1, 0)  # one host: node 0
    assert (culprit.host, culprit.pid) == (ranks[1]["host"], ranks[1]["pid"])
    # Within the step: between rank 0's call and its return, and there when the step published.
    start, end = ranks[0]["window"]
    assert start <= incident.detected_at <= end
    published = next(s for s in ranks[0]["seen"] if s[0] == NAN_STEP)
    assert published == (NAN_STEP, "rollback", [incident.key])
    assert all(not keys for step, _, keys in ranks[0]["seen"][: NAN_STEP - 1])
    assert incident.recovered_at is not None and incident.recovered_at <= end
    assert 0 < incident.lost_seconds <= incident.recovered_at - start + 30


def test_the_sum_payload_is_as_long_at_world_2_as_at_world_1(job, tmp_path):
    _, ranks = job
    (alone,) = run_world(nan_on_rank1, str(tmp_path), NAN_STEP, NAN_STEP - 1, world=1, timeout=180)
    two = ranks[0]["sum_len"][: NAN_STEP - 1]
    assert len(two) == NAN_STEP - 1, two
    # A sampled step carries three more floats where there is more than one rank to tell
    # apart: the flags of the ranks whose own activations were far out (the same three at any
    # world size); every other step is as long as alone.
    sampled = ranks[0]["sampled"][: NAN_STEP - 1]
    assert any(sampled) and not all(sampled), sampled
    assert [n - 3 * s for n, s in zip(two, sampled)] == alone["sum_len"], (two, alone["sum_len"])
