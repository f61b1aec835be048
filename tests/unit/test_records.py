"""The job's records carry their schema version, and a reader meets another version by name;
every record file is written one way (a whole file or none, one winner of a race for a name).

The records written before the version field existed (version 1, no ``v``) read as they did.
"""

from __future__ import annotations

import json
import threading

import pytest

from torchvitals.errors import TorchvitalsError
from torchvitals.records.durable import create_json, replace_json
from torchvitals.records.goodput import account
from torchvitals.records.incidents import Culprit, Incident, IncidentLog
from torchvitals.records.ledger import Ledger, LedgerError
from torchvitals.records.schema import SCHEMA_VERSION, RecordVersionError, check_version
from torchvitals.records.timeline import StepTimeline


def _steps(folder):
    timeline = StepTimeline(folder, attempt=0, pid=1)
    timeline.start(at=100.0, resumed=0)
    for step in range(1, 4):
        timeline.step(step, end=100.0 + step, seconds=1.0)
    return timeline


def test_every_timeline_line_carries_the_schema_version(tmp_path):
    timeline = _steps(tmp_path)
    lines = [json.loads(x) for x in timeline._lines.path.read_text().splitlines()]
    assert [line["v"] for line in lines] == [SCHEMA_VERSION] * 4
    assert not account(tmp_path).problems


def test_lines_without_a_version_read_as_version_1(tmp_path):
    timeline = _steps(tmp_path)
    path = timeline._lines.path
    unversioned = [
        {k: v for k, v in json.loads(x).items() if k != "v"} for x in path.read_text().splitlines()
    ]
    before = account(tmp_path)
    path.write_text("".join(json.dumps(r) + "\n" for r in unversioned))
    after = account(tmp_path)
    assert not after.problems and after.steps == before.steps == 3
    assert after.productive_seconds == before.productive_seconds


def test_a_line_of_a_newer_schema_is_named_and_skipped(tmp_path):
    timeline = _steps(tmp_path)
    with open(timeline._lines.path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"v": SCHEMA_VERSION + 1, "e": "step", "s": 4, "t": 105, "d": 1}) + "\n")
    g = account(tmp_path)
    assert g.steps == 3
    (problem,) = g.problems
    assert problem.startswith(f"{timeline._lines.path}:5: written with record schema version 2")
    assert "newer torchvitals" in problem


def _incident(**changes):
    fields = dict(
        kind="hang",
        key="hang-a0001",
        step=3,
        culprit=Culprit(rank=1),
        cause="rank 1 is stopped",
        detected_at=10.0,
    )
    return Incident(**(fields | changes))


def test_an_incident_of_a_newer_schema_is_named_and_the_others_read(tmp_path):
    log = IncidentLog(tmp_path)
    assert log.record(_incident())
    written = json.loads((log.path / "hang-a0001.json").read_text())
    assert written["v"] == SCHEMA_VERSION
    newer = dict(written, key="crash-a0002", kind="crash", v=SCHEMA_VERSION + 1)
    (log.path / "crash-a0002.json").write_text(json.dumps(newer))
    old = {k: v for k, v in dict(written, key="hang-a0000").items() if k != "v"}
    (log.path / "hang-a0000.json").write_text(json.dumps(old))
    found, problems = log.read()
    assert [i.key for i in found] == ["hang-a0000", "hang-a0001"]
    (problem,) = problems
    assert "crash-a0002.json" in problem and "schema version 2" in problem, problem


def test_a_ledger_of_a_newer_schema_is_refused_by_name_and_left_alone(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.record_checkpoint(10, str(tmp_path / "step-00000010"))
    document = json.loads(ledger.path.read_text())
    assert document["version"] == SCHEMA_VERSION
    text = json.dumps(dict(document, version=SCHEMA_VERSION + 1))
    ledger.path.write_text(text)
    with pytest.raises(LedgerError, match="schema version 2 by a newer torchvitals"):
        Ledger(ledger.path, writer=False).load()
    assert ledger.path.read_text() == text


def test_the_version_error_is_a_torchvitals_error_and_names_an_unknown_version():
    with pytest.raises(RecordVersionError, match="'x' is not one this torchvitals reads"):
        check_version("x", "f.json")
    assert issubclass(RecordVersionError, TorchvitalsError)
    check_version(SCHEMA_VERSION, "f.json")


def test_one_writer_of_many_wins_a_name_and_the_file_is_whole(tmp_path):
    path = tmp_path / "incidents" / "hang-a0001.json"
    barrier = threading.Barrier(8)
    won = []

    def race(i: int) -> None:
        barrier.wait()
        if create_json(path, {"writer": i, "pad": "x" * 100_000}):
            won.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and json.loads(path.read_text())["writer"] == won[0]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_a_replace_leaves_the_old_file_whole_when_the_new_value_cannot_be_written(tmp_path):
    path = tmp_path / "ledger.json"
    replace_json(path, {"a": 1})
    with pytest.raises(TypeError):
        replace_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.json"]
