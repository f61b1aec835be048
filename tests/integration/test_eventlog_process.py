"""The event log loses nothing when its process dies without closing it (a fresh process that
leaves with os._exit).

    python -m pytest tests/integration/test_eventlog_process.py
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from torchvitals.agent.outputs.eventlog import read_events


def test_nothing_lost_when_the_process_dies(tmp_path):
    path = tmp_path / "events.jsonl"
    script = textwrap.dedent(f"""
        import os
        from torchvitals.agent.outputs.eventlog import EventLog
        from torchvitals.agent.report import Report
        log = EventLog({str(path)!r})
        log.write(Report(step=1, loss=0.5, grad_norm={{}}, grad_norm_total=0.0))
        os._exit(1)  # no close, no atexit, no finalizers
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True)
    assert proc.returncode == 1, proc.stderr.decode()
    assert [e["step"] for e in read_events(path)] == [1]
