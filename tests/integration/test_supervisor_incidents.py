"""The supervisor names the culprit of a real job's hang or crash: torchrun, two gloo ranks that
all-reduce every step (``incident_ranks.py``), a fault injected once at a named rank and step.

    python -m pytest tests/integration/test_supervisor_incidents.py -s   # -s: the timings

Each test reads the incident the supervisor wrote into the job's folder, checks it against the
truth the faulty rank recorded (its pid, the time of the fault), and that the job recovered:
a stopped rank (its /proc state), a rank spinning in user code while the other waits in its
all_reduce (its frame), a rank exiting with status 13 (torchrun's report), and torchrun's restart
of its workers hanging at startup (the learned bound, not the cold-start timeout).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchvitals.records.incidents import Incident, IncidentLog
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.supervisor import Supervisor
from torchvitals.supervisor.telemetry import SupervisorMetrics

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

RANKS = Path(__file__).with_name("incident_ranks.py")
ROOT = Path(__file__).resolve().parents[2]
PYTHONPATH = os.pathsep.join(p for p in (str(ROOT.parent), os.environ.get("PYTHONPATH")) if p)
HOST = socket.gethostname()


def torchrun(tmp_path: Path, fault: str, rank: int, *args: str, restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.1",
        str(RANKS),
        "--marks",
        str(tmp_path),
        "--out",
        str(tmp_path / "out.jsonl"),
        "--steps",
        "30",
        "--fault",
        fault,
        "--fault-rank",
        str(rank),
        "--fault-step",
        "5",
        *args,
    ]


FLAGS = (
    "--hang-timeout-s",
    "3",
    "--startup-timeout-s",
    "60",
    "--grace-s",
    "2",
    "--backoff-s",
    "0.1",
    "--poll-s",
    "0.1",
)


def supervise(
    tmp_path: Path, *flags: str, command: list[str], timeout: float = 100
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torchvitals",
            "supervise",
            "--checkpoint-dir",
            str(tmp_path / "job"),
            "--heartbeat-root",
            str(tmp_path / "hb"),
            *FLAGS,
            *flags,
            "--",
            *command,
        ],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def incidents(tmp_path: Path) -> dict[str, Incident]:
    found, problems = IncidentLog(tmp_path / "job").read()
    assert not problems
    return {i.key: i for i in found}


def fault(tmp_path: Path, name: str) -> dict:
    """What the faulty rank recorded: its pid and the unix time of the fault."""
    return json.loads((tmp_path / f"fault-{name}").read_text())


def timeline(tmp_path: Path) -> list[dict]:
    path = tmp_path / "job" / "goodput" / "supervisor-node0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def finished(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]


def report(name: str, incident: Incident, fault_at: float) -> None:
    """The incident and its timings, for the note (pytest -s)."""
    print(f"\n--- {name}: {json.dumps(incident.to_dict(), indent=1)}")
    localized = incident.localized_at or incident.detected_at
    print(
        f"--- {name}: detected {incident.detected_at - fault_at:.2f} s after the fault, "
        f"localized {localized - incident.detected_at:.2f} s after detection, recovered "
        f"{(incident.recovered_at or 0) - fault_at:.2f} s after the fault, "
        f"lost_seconds {incident.lost_seconds}"
    )


def recovered(incident: Incident, run_after: dict) -> None:
    """Recovered at the restart's first heartbeat, before the restarted job finished; its cost
    runs from the last heartbeat before the fault to that first new one."""
    assert incident.recovered_at is not None and incident.lost_seconds is not None
    assert incident.localized_at is None or incident.localized_at <= incident.recovered_at
    assert incident.detected_at < incident.recovered_at < run_after["time"]
    assert incident.lost_seconds >= incident.recovered_at - incident.detected_at - 0.001


def test_a_stopped_rank_is_named_with_its_state_before_it_is_stopped(tmp_path):
    run = supervise(tmp_path, command=torchrun(tmp_path, "stop", 1))
    assert run.returncode == 0, run.stderr[-4000:]
    truth = fault(tmp_path, "stop")
    found = incidents(tmp_path)
    assert list(found) == ["hang-a0001"], found
    hang = found["hang-a0001"]
    report("stopped rank", hang, truth["time"])
    assert (hang.kind, hang.attempt, hang.culprit.rank, hang.culprit.node) == ("hang", 1, 1, 0)
    assert (hang.culprit.pid, hang.culprit.host) == (truth["pid"], HOST)
    assert hang.cause == f"rank 1 (node 0, host {HOST}, pid {truth['pid']}) is stopped (SIGSTOP)"
    assert hang.evidence["rule"] == "stopped" and hang.evidence["state"] == "T"
    # The other rank was asked for its stack and answered from its all_reduce.
    other = next(r for r in hang.evidence["ranks"] if r["rank"] == 0)
    assert other["waiting"] is True and other["asked"] is True and other["state"] in "RS"
    assert other["frame"].endswith(" in all_reduce")
    # Detected after the 3 s timeout (a heartbeat advance at most one step before the fault).
    assert 2.5 < hang.detected_at - truth["time"] < 10
    assert hang.detected_at <= hang.localized_at < hang.detected_at + 3
    recovered(hang, finished(tmp_path)[-1])
    # The log line names the culprit where the hang is reported.
    assert "no heartbeat advance for" in run.stderr
    assert (
        "is stopped (SIGSTOP)" in run.stderr.split("no heartbeat advance for", 1)[1].split("\n")[0]
    )
    events = [(e["e"], e.get("a"), e.get("reason")) for e in timeline(tmp_path)]
    assert events == [
        ("wait", 1, None),
        ("attempt", 1, "hang"),
        ("wait", 2, None),
        ("attempt", 2, "exit"),
        ("end", None, None),
    ]


def test_a_rank_spinning_in_user_code_is_named_with_its_frame(tmp_path):
    metrics = SupervisorMetrics()
    config = SupervisorConfig(
        hang_timeout_s=3,
        startup_timeout_s=60,
        grace_s=2,
        backoff_s=0.1,
        poll_s=0.1,
        checkpoint_dir=str(tmp_path / "job"),
        heartbeat_root=str(tmp_path / "hb"),
    )
    supervisor = Supervisor(
        config,
        torchrun(tmp_path, "spin", 0),
        metrics=metrics,
        environ={**os.environ, "PYTHONPATH": PYTHONPATH},
    )
    assert supervisor.run() == 0
    truth = fault(tmp_path, "spin")
    hang = incidents(tmp_path)["hang-a0001"]
    report("spinning rank", hang, truth["time"])
    assert (hang.culprit.rank, hang.culprit.node, hang.culprit.pid) == (0, 0, truth["pid"])
    assert hang.evidence["rule"] == "spinning" and hang.evidence["state"] == "R"
    frame = hang.evidence["frame"]
    assert frame.startswith(f'File "{RANKS}", line ') and frame.endswith(" in spin_forever")
    assert frame in hang.cause and "while rank 1 waits in one" in hang.cause
    waiting = next(r for r in hang.evidence["ranks"] if r["rank"] == 1)
    assert waiting["waiting"] is True and waiting["frame"].endswith(" in all_reduce")
    recovered(hang, finished(tmp_path)[-1])
    first, second = supervisor.history
    assert (first.reason, first.incident, second.reason, second.status) == (
        "hang",
        "hang-a0001",
        "exit",
        0,
    )
    labels = {"kind": "hang", "rank": "0", "node": "0", "host": HOST}
    value = metrics.registry.get_sample_value
    assert value("torchvitals_supervisor_incidents_total", labels) == 1


def test_a_rank_exiting_13_is_named_with_its_status_and_torchruns_report(tmp_path):
    run = supervise(tmp_path, command=torchrun(tmp_path, "exit13", 1))
    assert run.returncode == 0, run.stderr[-4000:]
    truth = fault(tmp_path, "exit13")
    found = incidents(tmp_path)
    assert list(found) == ["crash-a0001"], found
    crash = found["crash-a0001"]
    report("exit 13", crash, truth["time"])
    assert (crash.culprit.rank, crash.culprit.node, crash.culprit.pid) == (1, 0, truth["pid"])
    assert crash.evidence["exit_status"] == 13
    assert (
        f"failed (exitcode: 13) local_rank: 1 (pid: {truth['pid']})" in crash.evidence["torchrun"]
    )
    assert crash.cause.endswith("died first: exit status 13")
    # The other rank died after it (torchrun's SIGTERM), and is listed second.
    assert [d["rank"] for d in crash.evidence["deaths"]] == [1, 0]
    assert crash.detected_at - truth["time"] < 60
    recovered(crash, finished(tmp_path)[-1])
    # torchrun's own output still reaches the supervisor's stderr, unchanged.
    assert "failed (exitcode: 13) local_rank: 1" in run.stderr


@pytest.mark.timeout(180)
def test_torchruns_restart_stuck_at_startup_is_a_hang_within_the_learned_bound(tmp_path):
    # torchrun restarts its workers after rank 1 exits 13 (--max-restarts 1), and the restarted
    # workers never reach their first heartbeat. Bound: the default 3 x the first start, with a
    # floor of 4 s instead of 60 (a next attempt's start on a loaded machine can take twice the
    # first's: a tighter factor would take it for stuck too).
    started = time.time()
    run = supervise(
        tmp_path,
        "--restart-floor-s",
        "4",
        command=torchrun(tmp_path, "exit13", 1, "--stuck-restart", restarts=1),
        timeout=160,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    truth = fault(tmp_path, "exit13")
    found = incidents(tmp_path)
    assert sorted(found) == ["crash-a0001", "hang-a0001-r1"], found
    crash, stuck = found["crash-a0001"], found["hang-a0001-r1"]
    report("exit 13 under torchrun's restarts", crash, truth["time"])
    report("restart stuck at startup", stuck, truth["time"])
    assert (crash.culprit.rank, crash.evidence["exit_status"]) == (1, 13)
    evidence = stuck.evidence
    assert evidence["stuck"] == "startup after restart" and evidence["phase"] == "restart"
    assert evidence["bound_s"] == pytest.approx(max(4.0, 3 * evidence["first_start_s"]), abs=0.01)
    assert stuck.cause.startswith(
        f"startup after restart took more than {evidence['bound_s']:.1f} s"
    )
    assert stuck.culprit.rank is None  # nobody to name: no restarted worker ever beat
    # Named within the bound after the workers died, far from the 60 s startup timeout.
    assert stuck.detected_at - crash.detected_at < evidence["bound_s"] + 3
    # The whole job restarted (attempt 2) and finished; both incidents recovered there.
    assert finished(tmp_path)[-1]["attempt"] == 2
    recovered(stuck, finished(tmp_path)[-1])
    # One stall, charged once: the crash up to the stuck restart's detection, the rest to it.
    assert crash.recovered_at == stuck.recovered_at
    assert crash.lost_seconds is not None and stuck.lost_seconds is not None
    assert crash.lost_seconds >= stuck.detected_at - crash.detected_at - 0.001
    assert stuck.lost_seconds == pytest.approx(stuck.recovered_at - stuck.detected_at, abs=0.001)
    print(f"--- the whole test took {time.time() - started:.1f} s")
