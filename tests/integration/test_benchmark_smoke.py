"""The benchmarks run end to end: the overhead benchmark on a tiny model prints one ratio row per
variant, the payload benchmark shows the step's SUM payload independent of the world size, the
scrape benchmark prints one ratio row per phase and what the flood's clients got.

    python -m pytest tests/integration/test_benchmark_smoke.py

Timings they print are measurements, never asserted; the payload's size is a count.
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
        [
            sys.executable,
            SCRIPT,
            "--small",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--modes",
            "single",
            "--variants",
            ",".join(VARIANTS),
            "--json",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for variant in VARIANTS:
        row = rf"^single\s+{variant}\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+-\d+\.\d+"
        assert re.search(row, proc.stdout, re.MULTILINE), f"no row for {variant}:\n{proc.stdout}"
    result = json.loads(out.read_text())
    assert set(result["modes"]["single"]["variants"]) == set(VARIANTS)


def test_payload_benchmark_shows_a_payload_that_does_not_grow_with_the_world():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "payload.py"),
            "--worlds",
            "2,512",
            "--steps",
            "10",
            "--rounds",
            "1",
            "--onehot-max",
            "512",
            "--onehot-steps",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    (_w2, new2, _, old2, _), (_w512, new512, _, old512, _) = rows
    assert new2 == new512, "the SUM payload grew with the world"
    assert int(old512) - int(old2) == 2 * (512 - 2)  # the old one-hot vectors: 2 per rank


def test_scrape_benchmark_prints_a_ratio_row_per_phase(tmp_path):
    out = tmp_path / "scrape.json"
    tiny = ["--rounds", "1", "--steps", "3", "--warmup", "1", "--width", "16", "--depth", "1"]
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "scrape.py"),
            *tiny,
            "--batch",
            "4",
            "--rate",
            "100",
            "--json",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    phases = ("bare", "idle", "flood", "elsewhere")
    for phase in phases:
        row = rf"^{phase}\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+-\d+\.\d+"
        assert re.search(row, proc.stdout, re.MULTILINE), f"no row for {phase}:\n{proc.stdout}"
    assert re.search(r"^flood / elsewhere: \d+\.\d+", proc.stdout, re.MULTILINE), proc.stdout
    result = json.loads(out.read_text())
    assert set(result["summary"]) == set(phases)
    assert set(result["answers"]) == {"flood", "elsewhere"}
