"""Unit tests for the JSON-lines event log: python -m pytest tests/unit/test_eventlog.py"""

from __future__ import annotations

import json
import math

import pytest

from torchvitals.agent.outputs.eventlog import EventLog, read_events
from torchvitals.agent.report import Report


def make_report(step: int, **kw) -> Report:
    fields = dict(
        step=step,
        loss=1.0 / step,
        grad_norm={"embed": 0.5, "head": 2.0},
        grad_norm_total=2.5,
        world_size=2,
        rank=0,
        local_loss=0.9,
        step_seconds=0.1,
    )
    fields.update(kw)
    return Report.from_flat(**fields)


def test_round_trip_with_nonfinite_values(tmp_path):
    path = tmp_path / "deep" / "run" / "events.jsonl"
    reports = [
        make_report(
            1,
            update_ratio={"embed": 1e-3},
            update_ratio_step=0,
            activations={
                "head": {
                    "mean": 0.0,
                    "rms": 1.0,
                    "abs_max": math.inf,
                    "zero_fraction": 0.0,
                    "saturation_fraction": 0.0,
                    "nonfinite": 3.0,
                }
            },
        ),
        make_report(
            2,
            loss=math.nan,
            grad_norm={"embed": -math.inf, "head": 1.0},
            grad_norm_total=math.nan,
            nonfinite=True,
            nonfinite_loss=True,
            action="skip",
            mean_step_seconds=0.15,
            compute_seconds=0.1,
        ),
    ]
    with EventLog(path) as log:
        assert all(log.write(r) for r in reports)
    events = read_events(path)
    assert events == [{"event": "step", **r.to_dict()} for r in reports]
    assert events[1]["loss"] == "nan"
    assert events[1]["grad_norm"] == {"embed": "-inf", "head": 1.0}
    assert events[0]["activations"]["head"]["abs_max"] == "inf"
    # Strict JSON on disk: no bare NaN/Infinity tokens that jq and others reject.
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_every_keeps_skips_nonfinite_and_verdicts(tmp_path):
    path = tmp_path / "events.jsonl"
    special = {3: dict(nonfinite=True), 7: dict(action="skip"), 11: dict(verdicts=["spike"])}
    with EventLog(path, every=5) as log:
        written = [
            r.step
            for r in (make_report(s, **special.get(s, {})) for s in range(1, 13))
            if log.write(r)
        ]
    assert written == [3, 5, 7, 10, 11]
    assert [e["step"] for e in read_events(path)] == written


def test_line_is_visible_to_another_reader_before_close(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    try:
        log.write(make_report(1))
        with open(path, encoding="utf-8") as reader:
            assert json.loads(reader.read())["step"] == 1
        log.write(make_report(2))
        assert [e["step"] for e in read_events(path)] == [1, 2]
    finally:
        log.close()
    log.close()  # idempotent


def test_appends_to_an_existing_log(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.write(make_report(1))
    with EventLog(path) as log:
        log.write(make_report(2))
    assert [e["step"] for e in read_events(path)] == [1, 2]


def test_read_events_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    good = json.dumps(make_report(1).to_dict())
    path.write_text(good + "\n" + good[: len(good) // 2])
    assert [e["step"] for e in read_events(path)] == [1]
    path.write_text(good[: len(good) // 2] + "\n" + good + "\n")
    with pytest.raises(json.JSONDecodeError):
        read_events(path)


def test_every_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="every"):
        EventLog(tmp_path / "events.jsonl", every=0)
