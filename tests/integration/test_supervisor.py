"""The supervisor keeps a real 2-rank gloo job alive: a killed rank, a stopped rank, a job that
never starts.

    python -m pytest tests/integration/test_supervisor.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.ports import free_port

from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.supervisor import Supervisor
from torchvitals.supervisor.telemetry import SupervisorMetrics

JOB = Path(__file__).with_name("supervised_job.py")
ROOT = Path(__file__).resolve().parents[2]
# The checkout's parent (a checkout named "torchvitals" imports as the package), then the
# caller's path: a checkout under another name is found through it, not the installed copy.
PYTHONPATH = os.pathsep.join(p for p in (str(ROOT.parent), os.environ.get("PYTHONPATH")) if p)


def job(tmp_path: Path, fault: str) -> list[str]:
    return [
        sys.executable,
        str(JOB),
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / "out.jsonl"),
        "--steps",
        "20",
        "--fault",
        fault,
        "--fault-step",
        "12",
    ]


def supervise_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    return subprocess.run(
        [sys.executable, "-m", "torchvitals", "supervise", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def attempts(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]


def last_healthy(tmp_path: Path) -> int:
    ledger = json.loads((tmp_path / "ckpt" / "ledger.json").read_text())
    return [e for e in ledger["entries"] if e["event"] == "checkpoint"][-1]["step"]


@pytest.mark.distributed
def test_a_killed_rank_is_restarted_and_the_job_resumes_from_the_last_healthy_checkpoint(tmp_path):
    run = supervise_cli(
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--heartbeat-root",
        str(tmp_path / "hb"),
        "--backoff-s",
        "0.1",
        "--grace-s",
        "2",
        "--hang-timeout-s",
        "30",
        "--startup-timeout-s",
        "60",
        "--",
        *job(tmp_path, "kill"),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "ckpt" / "fault-kill-done").exists()
    # Rank 1 died at step 12: the first attempt never finished, the second resumed from the
    # checkpoint of step 10 (every 5 steps) and ran to step 20.
    assert attempts(tmp_path) == [{"resumed_from": 10, "last_step": 20}]
    assert last_healthy(tmp_path) == 20
    assert sorted(p.name for p in (tmp_path / "hb").iterdir()) == ["attempt-0001", "attempt-0002"]
    assert "ended by crash" in run.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stopped_rank_is_detected_as_a_hang_and_the_job_restarted(tmp_path):
    config = SupervisorConfig(
        hang_timeout_s=3,
        startup_timeout_s=60,
        checkpoint_timeout_s=30,
        grace_s=2,
        backoff_s=0.1,
        poll_s=0.1,
        checkpoint_dir=str(tmp_path / "ckpt"),
        heartbeat_root=str(tmp_path / "hb"),
    )
    metrics = SupervisorMetrics()
    started = time.monotonic()
    supervisor = Supervisor(config, job(tmp_path, "stop"), metrics=metrics)
    assert supervisor.run() == 0
    assert time.monotonic() - started < 45
    first, second = supervisor.history
    assert (first.reason, second.reason, second.status) == ("hang", "exit", 0)
    # Rank 1 stopped itself right after writing the marker. The last heartbeat advance the
    # supervisor sees comes at most a beat interval (1 s) before that, or up to 1 s after it:
    # rank 0's beat of the same step, held back by the interval, is flushed by its timer. So the
    # hang is seen 2..4 s after the stop, plus a poll and the localization (a /proc read and
    # rank 0's stack dump) before the group is stopped.
    stopped_at = (tmp_path / "ckpt" / "fault-stop-done").stat().st_mtime
    assert 2 - 0.2 <= first.ended - stopped_at <= 4 + 1.0, first.ended - stopped_at
    assert first.incident == "hang-a0001"
    # SIGTERM (with SIGCONT for the stopped rank) ends the whole group: no wait for SIGKILL.
    assert second.started - first.ended < config.grace_s
    assert attempts(tmp_path) == [{"resumed_from": 10, "last_step": 20}]
    value = metrics.registry.get_sample_value
    assert value("torchvitals_supervisor_restarts_total", {"reason": "hang"}) == 1
    assert value("torchvitals_supervisor_restarts_total", {"reason": "crash"}) == 0
    assert value("torchvitals_supervisor_attempt") == 2


def test_a_job_that_crashes_at_start_stops_when_the_restart_budget_is_spent(tmp_path):
    started = time.monotonic()
    run = supervise_cli(
        "--max-restarts",
        "2",
        "--no-progress-restarts",
        "5",
        "--backoff-s",
        "0.05",
        "--grace-s",
        "1",
        "--",
        sys.executable,
        "-c",
        "raise SystemExit(3)",
    )
    assert run.returncode == 77, run.stderr[-3000:]
    assert run.stderr.count("ended by crash (status 3)") == 3
    assert time.monotonic() - started < 15


def test_restarts_without_progress_stop_with_their_own_exit_code(tmp_path):
    metrics = SupervisorMetrics()
    config = SupervisorConfig(
        max_restarts=10,
        no_progress_restarts=2,
        backoff_s=0.05,
        grace_s=1,
        poll_s=0.05,
        heartbeat_root=str(tmp_path / "hb"),
    )
    status = Supervisor(
        config, [sys.executable, "-c", "raise SystemExit(3)"], metrics=metrics
    ).run()
    assert status == 76
    assert (
        metrics.registry.get_sample_value(
            "torchvitals_supervisor_restarts_total", {"reason": "crash"}
        )
        == 2
    )
    assert metrics.registry.get_sample_value("torchvitals_supervisor_attempt") == 3


WORKER_IN_OWN_SESSION = """
import os, signal, subprocess, sys, time
from pathlib import Path
marker = Path(sys.argv[1])
if len(sys.argv) > 2:                       # the worker: beat once, then stop (first time only)
    from torchvitals.agent.recover.heartbeat import Heartbeat
    Heartbeat(os.environ["TORCHVITALS_HEARTBEAT_DIR"], 0).beat(1)
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    sys.exit(0)
# the launcher, like torchrun: its worker runs in a session of its own
sys.exit(subprocess.call([sys.executable, __file__, sys.argv[1], "worker"], start_new_session=True))
"""


def test_a_worker_outside_the_launchers_process_group_is_stopped_too(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(WORKER_IN_OWN_SESSION)
    config = SupervisorConfig(
        hang_timeout_s=1,
        startup_timeout_s=30,
        grace_s=2,
        backoff_s=0.05,
        poll_s=0.05,
        heartbeat_root=str(tmp_path / "hb"),
    )
    supervisor = Supervisor(
        config,
        [sys.executable, str(script), str(tmp_path / "stopped")],
        environ={**os.environ, "PYTHONPATH": PYTHONPATH},
    )
    assert supervisor.run() == 0
    worker = int((tmp_path / "stopped").read_text())
    state = Path(f"/proc/{worker}/stat")
    assert not state.exists() or state.read_text().rsplit(")", 1)[1].split()[0] == "Z", (
        "the stopped worker outlived the supervision"
    )
    assert [a.reason for a in supervisor.history] == ["hang", "exit"]


@pytest.mark.distributed
def test_a_job_that_aborts_itself_is_not_restarted(tmp_path):
    # NaN at every step from 12 on (checkpoints every 5): each rollback meets the NaN again,
    # each repeat goes further back, and with no checkpoint left (or the loop guard's count
    # reached) the watchdog aborts every rank. The launcher (like torchrun) reports only "a
    # worker failed", exit 1; the heartbeat says the abort was on purpose, and a restart would
    # undo it.
    run = supervise_cli(
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--heartbeat-root",
        str(tmp_path / "hb"),
        "--backoff-s",
        "0.1",
        "--grace-s",
        "2",
        "--hang-timeout-s",
        "30",
        "--startup-timeout-s",
        "60",
        "--",
        *job(tmp_path, "nan"),
    )
    assert run.returncode == 75, run.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "hb").iterdir()) == ["attempt-0001"]
    assert "aborted itself" in run.stderr
    ledger = json.loads((tmp_path / "ckpt" / "ledger.json").read_text())
    events = [e["event"] for e in ledger["entries"]]
    assert 1 <= events.count("rollback") <= 3 and events[-1] == "abort", events


def scrape_while_running(url: str, *flags: str, context=None) -> tuple[str, str]:
    """Start ``supervise`` around a 20 s sleep with ``flags``, scrape ``url`` once it answers,
    stop the supervisor; returns (the scrape, the supervisor's stderr)."""
    import signal
    import urllib.request

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchvitals",
            "supervise",
            *flags,
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(20)",
        ],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2, context=context) as r:
                    body = r.read().decode()
                break
            except OSError as exc:  # refused: not listening yet; anything else answers
                up = not isinstance(getattr(exc, "reason", exc), ConnectionRefusedError)
                if up or time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    return body, err


def test_the_supervisor_metrics_bind_where_told(tmp_path):
    # 127.0.0.2 is loopback too on Linux, and not where the default binds: a scrape there
    # proves --metrics-host was honoured (a pod's IP in the chart).
    port = free_port()
    body, _ = scrape_while_running(
        f"http://127.0.0.2:{port}/metrics",
        "--metrics-port",
        str(port),
        "--metrics-host",
        "127.0.0.2",
        "--heartbeat-root",
        str(tmp_path / "hb"),
    )
    assert "torchvitals_supervisor_attempt 1.0" in body


def test_the_supervisor_metrics_serve_https_with_client_certificates(tmp_path):
    import ssl

    for name in ("server", "client"):
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "1",
                "-subj",
                f"/CN={name}",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-keyout",
                str(tmp_path / f"{name}.key"),
                "-out",
                str(tmp_path / f"{name}.crt"),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
    port = free_port()
    context = ssl.create_default_context(cafile=str(tmp_path / "server.crt"))
    context.load_cert_chain(str(tmp_path / "client.crt"), str(tmp_path / "client.key"))
    url = f"https://127.0.0.1:{port}/metrics"
    flags = (
        "--metrics-port",
        str(port),
        "--metrics-certfile",
        str(tmp_path / "server.crt"),
        "--metrics-keyfile",
        str(tmp_path / "server.key"),
        "--metrics-client-cafile",
        str(tmp_path / "client.crt"),
        "--heartbeat-root",
        str(tmp_path / "hb"),
    )
    body, _ = scrape_while_running(url, *flags, context=context)
    assert "torchvitals_supervisor_restarts_total" in body
    # Without a client certificate the handshake is refused.
    anonymous = ssl.create_default_context(cafile=str(tmp_path / "server.crt"))
    with pytest.raises(OSError):
        scrape_while_running(url, *flags, context=anonymous)
