"""The incident records: one per key whichever of several processes writes it first, updated by
their owner, bounded in number and size, read back field by field with every bad file named.

    python -m pytest tests/unit/test_incidents.py -q
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from torchvitals.records.incidents import (
    EVIDENCE_MAX_BYTES,
    Culprit,
    Incident,
    IncidentError,
    IncidentLog,
)
from torchvitals.records.vocabulary import KINDS


def incident(key: str = "hang-a0002", **changes) -> Incident:
    fields = {
        "kind": "hang",
        "key": key,
        "step": 41,
        "culprit": Culprit(rank=3, node=1, host="h1", pid=4711),
        "cause": "rank 3 is stopped (SIGSTOP)",
        "evidence": {"state": "T", "stack": "File x, line 1"},
        "detected_at": 1000.5,
        "attempt": 2,
        "writer": "supervisor node 1",
    }
    return Incident(**{**fields, **changes})


def test_a_second_record_of_a_key_is_refused_and_the_first_kept(tmp_path):
    log = IncidentLog(tmp_path)
    assert log.record(incident()) is True
    assert log.record(incident(cause="another node's view")) is False
    assert log.get("hang-a0002") == incident() and log.has("hang-a0002")


def test_update_fills_in_what_was_learned_after(tmp_path):
    log = IncidentLog(tmp_path)
    log.record(incident())
    updated = log.update("hang-a0002", recovered_at=1040.0, lost_seconds=38.5)
    assert updated == incident(recovered_at=1040.0, lost_seconds=38.5)
    assert log.get("hang-a0002") == updated
    assert log.read() == ([updated], [])
    assert log.update("crash-a0009", lost_seconds=1.0) is None  # never recorded
    with pytest.raises(IncidentError, match="kind"):
        log.update("hang-a0002", kind="flood")
    assert log.get("hang-a0002") == updated


def test_the_folder_keeps_limit_records_and_never_drops_the_one_just_written(tmp_path):
    log = IncidentLog(tmp_path, limit=3)
    ahead = time.time() + 3600
    for k in range(7):
        key = f"crash-a{k:04d}"
        assert log.record(incident(key, kind="crash", detected_at=1000.0 + k))
        assert log.has(key)
        # Written by a node whose clock runs an hour ahead (or stamped alike by a coarse
        # clock): the next record looks older than this one, and must stay all the same.
        os.utime(tmp_path / "incidents" / f"{key}.json", (ahead + k, ahead + k))
    found, _ = log.read()
    assert len(found) == 3 and found[-1].key == "crash-a0006"
    with pytest.raises(ValueError, match="limit"):
        IncidentLog(tmp_path, limit=0)


def test_the_oldest_records_go_first(tmp_path):
    log = IncidentLog(tmp_path, limit=2)
    for k in range(4):
        log.record(incident(f"crash-a{k:04d}", kind="crash"))
        path = tmp_path / "incidents" / f"crash-a{k:04d}.json"
        os.utime(path, (1_000_000 + k, 1_000_000 + k))  # written a second apart
    assert sorted(i.key for i in log.read()[0]) == ["crash-a0002", "crash-a0003"]


@pytest.mark.parametrize(
    "evidence",
    [
        {"stack": "frame\n" * 200_000},  # one huge stack: its end (the innermost frames) kept
        {f"rank{r}": "x" * 5_000 for r in range(500)},  # many big strings
        {"quotes": ['"\\' * 3_000 for _ in range(64)]},  # strings that grow when escaped
        {"é" * 40_000: 1},  # a huge key
        {"values": list(range(100_000))},
    ],
)
def test_evidence_is_bounded_whatever_it_holds(tmp_path, evidence):
    bounded = incident(evidence=evidence).to_dict()["evidence"]
    assert len(json.dumps(bounded)) <= EVIDENCE_MAX_BYTES
    log = IncidentLog(tmp_path)
    assert log.record(incident(evidence=evidence))
    assert log.get("hang-a0002") is not None  # it reads back


def test_a_stack_keeps_its_innermost_frames():
    stack = "".join(f"  File 'train.py', line {n}\n" for n in range(50_000)) + "  spin_forever\n"
    kept = incident(evidence={"stack": stack}).to_dict()["evidence"]["stack"]
    assert kept.startswith("[...]") and kept.endswith("spin_forever\n")


def test_a_record_round_trips_through_its_dict():
    full = incident(localized_at=1001.0, recovered_at=1040.0, lost_seconds=38.5)
    assert Incident.from_dict(json.loads(json.dumps(full.to_dict()))) == full
    assert (
        Incident.from_dict(
            {
                "kind": "node_lost",
                "key": "node_lost-a0001-n1",
                "cause": "gone",
                "detected_at": 5,
                "step": None,
            }
        ).culprit
        == Culprit()
    )


@pytest.mark.parametrize(
    "change, named",
    [
        ({"kind": "flood"}, "kind"),
        ({"key": "../../etc/passwd"}, "key"),
        ({"step": "41"}, "step"),
        ({"step": True}, "step"),
        ({"culprit": {"rank": 3.5}}, "rank"),
        ({"culprit": {"host": 7}}, "host"),
        ({"culprit": [3]}, "culprit"),
        ({"cause": None}, "cause: missing"),
        ({"detected_at": "yesterday"}, "detected_at"),
        ({"detected_at": float("nan")}, "detected_at: not a finite number"),
        ({"lost_seconds": float("inf")}, "lost_seconds"),
        ({"evidence": "a stack"}, "evidence"),
        ({"attempt": 2.0}, "attempt"),
        ({"writer": ["a"]}, "writer"),
    ],
)
def test_from_dict_names_the_field_of_a_wrong_type(change, named):
    d = {**incident().to_dict(), **change}
    with pytest.raises(IncidentError, match=f"^where: .*{named}"):
        Incident.from_dict(d, "where")


def test_from_dict_refuses_what_is_not_an_object():
    with pytest.raises(IncidentError, match="where: not a JSON object"):
        Incident.from_dict([1, 2], "where")


def test_corrupt_files_are_named_and_the_others_read(tmp_path):
    log = IncidentLog(tmp_path)
    log.record(incident())
    folder = tmp_path / "incidents"
    (folder / "cut.json").write_text('{"kind": "hang", "key": ')
    (folder / "typed.json").write_text(json.dumps({**incident().to_dict(), "step": "x"}))
    (folder / "huge.json").write_text(" " * (4 * EVIDENCE_MAX_BYTES + 1))
    (folder / ".tmp-half.json").write_text("{")  # a writer's temporary file: not a record
    found, problems = log.read()
    assert found == [incident()]
    named = sorted(Path(p.split(": ")[0]).name for p in problems)
    assert named == ["cut.json", "huge.json", "typed.json"], problems
    assert any("typed.json: step: expected int" in p for p in problems), problems
    assert any("not JSON" in p for p in problems), problems
    assert log.get("cut") is None


def test_every_kind_is_a_valid_incident_and_a_line_reads_well():
    for kind in KINDS:
        assert incident(kind=kind).kind == kind
    assert incident().line() == (
        "hang at step 41: rank 3 (node 1, host h1, pid 4711): rank 3 is stopped (SIGSTOP)"
    )
    assert Culprit(node=1, host="h").describe() == "node 1 (host h)"
    assert Culprit().describe() == "unknown"
    spike = incident(kind="loss_spike", culprit=Culprit(), cause="the loss spiked to 3.9")
    assert spike.line() == "loss_spike at step 41: the loss spiked to 3.9"  # no "unknown: "
