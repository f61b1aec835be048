"""The overhead benchmark runs end to end on a tiny model and prints one ratio row per variant.

    python -m pytest tests/unit/test_benchmark_smoke.py

Only that it runs: the numbers it prints are measurements, never asserted.
"""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "overhead.py")
VARIANTS = ("bare", "default", "guarded", "naive")


def test_overhead_benchmark_prints_a_ratio_row_per_variant(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--small", "--rounds", "1", "--steps", "2", "--warmup", "1",
         "--modes", "single", "--variants", ",".join(VARIANTS), "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for variant in VARIANTS:
        row = rf"^single\s+{variant}\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+-\d+\.\d+"
        assert re.search(row, proc.stdout, re.MULTILINE), f"no row for {variant}:\n{proc.stdout}"
    result = json.loads(out.read_text())
    assert set(result["modes"]["single"]["variants"]) == set(VARIANTS)
