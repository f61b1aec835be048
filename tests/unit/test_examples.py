"""The README's first command runs: the quickstart trains and prints its per-block signals."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_prints_per_block_signals_and_writes_its_event_log(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py"),
                           "--steps", "12", "--metrics-port", "0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "step   10" in out and "step   12" in out
    for block in ("tok_emb", "blocks.0", "blocks.3", "lm_head"):
        assert any(line.split()[:1] == [block] for line in out.splitlines()), f"no row for {block}"
    logs = list(tmp_path.glob("torchvitals_runs/*/events.jsonl"))
    assert len(logs) == 1 and len(logs[0].read_text().splitlines()) == 12
