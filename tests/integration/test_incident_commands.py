"""``torchvitals incidents`` and ``torchvitals goodput`` as a person runs them after a job, in a
fresh process where torch cannot be imported, over a folder the real writers filled (a crash,
then a rollback).

    python -m pytest tests/integration/test_incident_commands.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.goodput_jobs import crash_then_rollback

from torchvitals.records.goodput import CAUSES
from torchvitals.records.incidents import Culprit, Incident, IncidentLog

NO_TORCH = 'raise ImportError("torch is not importable here: the command must not need it")\n'


def cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m torchvitals ARGS`` where ``import torch`` raises."""
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True, exist_ok=True)
    (shadow / "torch" / "__init__.py").write_text(NO_TORCH)
    path = os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "torchvitals", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path, **env},
        timeout=60,
        cwd=tmp_path,
    )


@pytest.fixture
def job(tmp_path) -> Path:
    """The crash-and-rollback job's folder, with the incidents its parts would record."""
    folder = tmp_path / "ckpt"
    crash_then_rollback(folder)
    log = IncidentLog(folder)
    log.record(
        Incident(
            kind="crash",
            key="crash-a0001",
            step=10,
            culprit=Culprit(rank=1, node=0, host="node-a", pid=4711),
            cause="rank 1 exited with status 13",
            evidence={"exitcode": 13},
            detected_at=1036.0,
            localized_at=1036.4,
            recovered_at=1055.2,
            attempt=1,
            writer="supervisor node 0",
        )
    )
    log.record(
        Incident(
            kind="nonfinite",
            key="nonfinite-a0002-s00000016",
            step=16,
            culprit=Culprit(rank=1),
            cause="NaN loss on rank 1",
            evidence={"block": "h.3.mlp"},
            detected_at=1068.0,
            localized_at=1068.0,
            recovered_at=1068.0,
            lost_seconds=9.5,
            attempt=2,
            writer="agent rank 0",
        )
    )
    return folder


def test_goodput_prints_the_accounting_and_its_json_adds_up(job, tmp_path):
    text = cli(tmp_path, "goodput", str(job))
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("goodput 0.390: 35.5 s productive of 91.0 s wall"), text.stdout
    for cause in CAUSES:
        assert f"  {cause} " in text.stdout
    assert "crash-a0001" in text.stdout and "25.0" in text.stdout
    out = cli(tmp_path, "goodput", str(job / "goodput"), "--json")  # its records' folder works too
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert (figures["wall_seconds"], figures["productive_seconds"]) == (91.0, 35.5)
    assert figures["goodput"] == pytest.approx(35.5 / 91)
    assert sum(figures["badput"].values()) + 35.5 == pytest.approx(91.0)
    assert figures["badput"]["lost_progress"] == pytest.approx(9 + 2 + 5.4)
    assert figures["incidents"] == [
        # From the last step before the crash (1030) until step 11, new, starts (1055).
        {"key": "crash-a0001", "kind": "crash", "lost_seconds": pytest.approx(25.0)},
        {"key": "nonfinite-a0002-s00000016", "kind": "nonfinite", "lost_seconds": 9.5},
    ]
    assert figures["problems"] == []
    env = cli(tmp_path, "goodput", str(job), TORCHVITALS_GOODPUT_JSON="true")
    assert json.loads(env.stdout) == figures


def test_goodput_of_a_folder_without_records_is_one_line_naming_it(tmp_path):
    empty = tmp_path / "nothing"
    empty.mkdir()
    out = cli(tmp_path, "goodput", str(empty))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and str(empty / "goodput") in out.stderr, out.stderr


def test_incidents_lists_each_with_its_culprit_timings_and_cost(job, tmp_path):
    out = cli(tmp_path, "incidents", str(job))
    assert out.returncode == 0, out.stderr
    header, crash, nonfinite = out.stdout.splitlines()
    assert header.split() == [
        "detected", "kind", "step", "rank", "node", "host", "pid", "localized", "recovered",
        "lost", "s", "cause",
    ]  # fmt: skip
    # The record has no lost_seconds: the accounting's figure, marked with ~.
    assert crash.split()[2:] == [
        "crash", "10", "1", "0", "node-a", "4711", "+0.4", "+19.2", "~25.0",
        "rank", "1", "exited", "with", "status", "13",
    ]  # fmt: skip
    assert nonfinite.split()[2:11] == ["nonfinite", "16", "1", "-", "-", "-", "+0.0", "+0.0", "9.5"]


def test_incidents_json_is_the_records_as_written(job, tmp_path):
    found, _ = IncidentLog(job).read()
    for folder in (job, job / "incidents"):
        out = cli(tmp_path, "incidents", str(folder), "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == [i.to_dict() for i in found]
    first = json.loads(out.stdout)[0]
    assert first["culprit"] == {"rank": 1, "node": 0, "host": "node-a", "pid": 4711}
    assert first["lost_seconds"] is None  # as recorded: --json never adds to a record
    env = cli(tmp_path, "incidents", str(job), TORCHVITALS_INCIDENTS_JSON="1")
    assert json.loads(env.stdout) == json.loads(out.stdout)


def test_a_corrupt_record_is_named_on_stderr_and_the_others_listed(job, tmp_path):
    (job / "incidents" / "hang-a0003.json").write_text('{"kind": "hang", "key": "hang-a0')
    out = cli(tmp_path, "incidents", str(job), "--json")
    assert out.returncode == 0
    assert [i["key"] for i in json.loads(out.stdout)] == [
        "crash-a0001",
        "nonfinite-a0002-s00000016",
    ]
    assert "hang-a0003.json" in out.stderr and "not JSON" in out.stderr


def test_bad_input_exits_2_with_one_line(job, tmp_path):
    missing = cli(tmp_path, "incidents", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "nowhere: not a folder" in missing.stderr
    bad_env = cli(tmp_path, "incidents", str(job), TORCHVITALS_INCIDENTS_JSON="maybe")
    assert bad_env.returncode == 2 and "TORCHVITALS_INCIDENTS_JSON" in bad_env.stderr
    empty = tmp_path / "quiet"
    empty.mkdir()
    none = cli(tmp_path, "incidents", str(empty), "--json")
    assert none.returncode == 0 and json.loads(none.stdout) == []


@pytest.mark.parametrize("command", ["incidents", "goodput"])
def test_help_gives_each_flag_its_default_and_variable(tmp_path, command):
    out = cli(tmp_path, command, "--help")
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    assert (
        f"--json print JSON (default: False; env TORCHVITALS_{command.upper()}_JSON)"
        in text.replace("--json, --no-json", "--json")
    )
