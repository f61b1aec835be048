"""The step report's shape: python -m pytest tests/unit/test_report.py

Its JSON (``to_dict``, an event log's line) round-trips, each record's fields under their flat
names; the rollback is a typed value with a JSON form, and the action compares equal to its
string.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

import torchvitals
from torchvitals.agent.detect.verdict import CRITICAL, LOSS_SPIKE, Verdict
from torchvitals.agent.jsonsafe import json_safe
from torchvitals.agent.report import (
    FLAT_NAMES,
    RECORDS,
    Action,
    Checkpointing,
    RankLocal,
    ReplicaCheck,
    Report,
    Rollback,
    StepTiming,
)


def _full() -> Report:
    """A report with every field away from its default, non-finite numbers included."""
    return Report(
        step=27,
        loss=math.inf,
        grad_norm={"embed": 0.5, "head": math.nan},
        grad_norm_total=3.5,
        grad_norm_missing=["head"],
        update_ratio={"embed": 1e-3},
        update_ratio_step=20,
        activations={"embed": {"mean": 0.1, "abs_max": -math.inf}},
        nonfinite=True,
        nonfinite_loss=True,
        verdicts=[Verdict(LOSS_SPIKE, CRITICAL, 27, None, {"loss": 9.0})],
        action=Action.ROLLBACK,
        rollback=Rollback(to_step=20, lr_scale=0.5, skipped=(20, 29)),
        lr=[1e-3, 5e-4],
        clip_coef=0.25,
        loss_scale=1024.0,
        overflow=True,
        memory={"resident_bytes": 1e9},
        custom={"my_signal": 2.5, "other": math.nan},
        world_size=4,
        rank=3,
        timing=StepTiming(0.5, 0.25, 0.6, 0.3, 0.01, 0.02, 0.1),
        checkpoint=Checkpointing(saved=True, committed=10, failed="step 15: disk full"),
        replicas=ReplicaCheck(checked=True, mismatch={"head": [2]}),
        local=RankLocal(loss=math.nan, samples=8, tokens=1024, accelerator_memory={"a": 1.0}),
    )


def _same(a: Report, b: Report) -> bool:
    """Equal, NaN equal to NaN (the JSON's "nan" reads back as a NaN)."""
    return json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)


def test_to_dict_is_flat_json_and_reads_back_as_the_same_report():
    report = _full()
    line = json.dumps(report.to_dict())  # strict JSON: no NaN tokens, no objects
    d = json.loads(line)
    assert d["loss"] == "inf" and d["grad_norm"]["head"] == "nan" and d["custom"]["other"] == "nan"
    assert d["action"] == "rollback"
    assert d["rollback"] == {
        "to_step": 20,
        "lr_scale": 0.5,
        "skipped": [20, 29],
        "repeat_of": None,
        "escalation": 0,
    }
    assert d["verdicts"] == [
        {
            "pattern": LOSS_SPIKE,
            "severity": CRITICAL,
            "step": 27,
            "block": None,
            "evidence": {"loss": 9.0},
        }
    ]
    # The records are written flat, under the names the readers have always read.
    assert not set(RECORDS) & set(d), "no nested record in the JSON"
    assert (d["checkpointed"], d["checkpoint_committed"], d["local_data_wait_seconds"]) == (
        True,
        10,
        0.01,
    )
    back = Report.from_dict(d)
    assert _same(back, report)
    assert back.action is Action.ROLLBACK and back.rollback == report.rollback
    assert back.verdicts == report.verdicts and math.isinf(back.loss)
    assert back.timing == report.timing and back.replicas == report.replicas
    assert math.isnan(back.local.loss) and back.local.samples == 8


def test_every_field_is_in_the_json_and_every_flat_name_too():
    d = Report(step=1).to_dict()
    top = {f.name for f in dataclasses.fields(Report)} - set(RECORDS)
    assert set(d) == top | set(FLAT_NAMES) | {"remedy"}  # derived from the action
    remedies = {a: Report(step=1, action=a).to_dict()["remedy"] for a in Action}
    assert remedies == {
        Action.STEP: "none",
        Action.SKIP: "skip_update",
        Action.ROLLBACK: "rollback",
        Action.ABORT: "abort",
    }
    for flat, (record, attr) in FLAT_NAMES.items():
        assert attr in {f.name for f in dataclasses.fields(RECORDS[record])}, flat


def test_a_report_needs_only_its_step_and_the_rest_means_unknown():
    report = Report(step=5)
    assert math.isnan(report.loss) and math.isnan(report.grad_norm_total)
    assert math.isnan(report.timing.step_seconds) and math.isnan(report.local.loss)
    assert report.action is Action.STEP and report.rollback is None and report.custom == {}
    assert report.local.samples is None and not report.checkpoint.saved
    # Every report gets records of its own: a signal writing one never writes another's.
    other = Report(step=6)
    other.replicas.mismatch["head"] = [1]
    assert report.replicas.mismatch == {}


def test_the_records_fields_go_to_the_event_log_under_their_flat_names_and_back():
    report = _full()
    line = report.to_dict()
    for flat, (record, attr) in FLAT_NAMES.items():
        assert line[flat] == json_safe(getattr(getattr(report, record), attr)), flat
        assert not hasattr(report, flat), f"{flat}: a report reads it as report.{record}.{attr}"
    assert Report.from_dict(line).to_dict() == line
    assert Report.from_flat(step=2, local_loss=0.5, checkpointed=True).checkpoint.saved


def test_the_rollback_is_a_typed_value_with_a_json_form():
    rolled = Rollback(to_step=20, lr_scale=0.25, skipped=(20, 34))
    assert (rolled.to_step, rolled.lr_scale, rolled.skipped) == (20, 0.25, (20, 34))
    assert rolled.to_dict() == {
        "to_step": 20,
        "lr_scale": 0.25,
        "skipped": [20, 34],
        "repeat_of": None,
        "escalation": 0,
    }
    assert Rollback.from_dict(rolled.to_dict()) == rolled
    reseeded = Rollback(to_step=20, lr_scale=0.5)
    assert reseeded.skipped is None and reseeded.to_dict()["skipped"] is None
    assert Rollback.from_dict(reseeded.to_dict()) == reseeded
    with pytest.raises(dataclasses.FrozenInstanceError):
        rolled.to_step = 3  # type: ignore[misc]


@pytest.mark.parametrize("action", list(Action))
def test_each_action_is_the_string_it_was(action):
    assert action == action.value and action.value == action
    assert str(action) == action.value and f"{action}" == action.value
    assert json.dumps({"action": action}) == json.dumps({"action": action.value})
    assert Action(action.value) is action
    assert {action.value: 1}[action] == 1  # hashes as its string
    assert torchvitals.Action is Action and torchvitals.Rollback is Rollback
    assert Report(step=1, action=action).to_dict()["action"] == action.value


def test_the_actions_are_the_four_users_compare_against():
    assert [a.value for a in Action] == ["step", "skip", "rollback", "abort"]
    assert Action.ROLLBACK != "skip" and Action.STEP in ("step", "skip")
