"""A collector that is killed and started again (a rescheduled pod) never orders twice: real
``python -m torchvitals.collector`` processes on one state folder, real HTTP.

    python -m pytest tests/integration/test_collector_restart.py

The kill is SIGKILL, the harshest a reschedule does (SIGTERM, then SIGKILL after the grace
period): nothing may depend on a clean shutdown.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from test_collector_webhook import (
    JOB_TOKENS,
    ROLLBACK,
    TOKEN,
    alert,
    job_auth,
    notification,
    request,
)

LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@contextmanager
def collector_process(state_dir: Path, timeout_s: float = 30.0):
    """``python -m torchvitals.collector --port 0`` on ``state_dir``; yields an object with
    ``.port`` (read from its log) and ``.proc``; killed (SIGKILL) on exit if still running."""
    env = {
        **os.environ,
        "TORCHVITALS_WEBHOOK_TOKEN": TOKEN,
        "TORCHVITALS_COLLECTOR_JOB_TOKENS": json.dumps(JOB_TOKENS),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchvitals.collector",
            "--port",
            "0",
            "--state-dir",
            str(state_dir),
            "--no-access-log",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"the collector did not listen within {timeout_s}s: {''.join(seen)}"
                ) from None
            seen.append(line)
            found = LISTENING.search(line)
            if found:
                break
            assert proc.poll() is None, f"the collector exited {proc.returncode}: {''.join(seen)}"
        yield SimpleNamespace(port=int(found.group(1)), proc=proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def kill(server) -> None:
    server.proc.send_signal(signal.SIGKILL)
    assert server.proc.wait(timeout=10) == -signal.SIGKILL


def test_an_acknowledged_directive_is_not_issued_again_after_a_killed_collector_restarts(tmp_path):
    state = tmp_path / "state"
    abort = alert(job="train-a", torchvitals_action="abort", fingerprint="fp-abort")
    with collector_process(state) as first:
        status, body = request(first, "POST", "/alerts", notification(ROLLBACK))
        assert status == 200 and body["outcomes"] == {"issued": 1}, body
        [rollback_id] = body["issued"]
        status, polled = request(
            first, "GET", "/directives?job=train-a&run=run-1", headers=job_auth()
        )
        assert [d["id"] for d in polled["directives"]] == [rollback_id]
        status, acked = request(first, "POST", f"/directives/{rollback_id}/ack", headers=job_auth())
        assert status == 200 and acked["acknowledged"] is True
        # A second order stays pending across the restart: the state is really read back,
        # not merely empty.
        [abort_id] = request(first, "POST", "/alerts", notification(abort))[1]["issued"]
        kill(first)

    with collector_process(state) as second:
        # Alertmanager repeats both still-firing alerts (each HA replica does): nothing new.
        for _ in range(2):
            status, body = request(second, "POST", "/alerts", notification(ROLLBACK, abort))
            assert (status, body) == (200, {"outcomes": {"duplicate": 2}, "issued": []}), body
        for run in ("run-1", "run-2"):  # the same run, and the job's next run
            status, polled = request(
                second, "GET", f"/directives?job=train-a&run={run}", headers=job_auth()
            )
            assert status == 200
            assert [d["id"] for d in polled["directives"]] == (
                [abort_id] if run == "run-1" else []
            ), polled
        status, again = request(
            second, "POST", f"/directives/{rollback_id}/ack", headers=job_auth()
        )
        assert status == 200 and again["acknowledged"] is False
        assert again["directive"]["acknowledged_at"] == acked["directive"]["acknowledged_at"]
        assert request(second, "GET", "/healthz", headers={})[1]["directives"] == {
            "pending": 1,
            "acknowledged": 1,
        }
