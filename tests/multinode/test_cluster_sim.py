"""The cluster simulator (``benchmarks/cluster_sim.py``) at 8 nodes: a crashed rank and a lost
node are named right, every node restarts, and nothing is left running. Counts, not times: the
times it prints are a benchmark's, on whatever else the machine runs.

    python -m pytest tests/multinode/test_cluster_sim.py -s     # -s shows the simulator's table
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import psutil
import pytest
from cluster import PYTHONPATH, ROOT

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SIM = ROOT / "benchmarks" / "cluster_sim.py"
TAG_ENV = "TORCHVITALS_CLUSTER_SIM_TAG"
NODES = 8


def tagged(tag: str) -> list[str]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG_ENV) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.pid} {' '.join(proc.cmdline()[:4])}")
        except psutil.Error:
            continue
    return found


def test_the_simulated_job_imports_no_torch():
    # Its ranks stand in for torch's, at many nodes on one machine: torch in each would not fit.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import sim_job, cluster_sim; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch.' in m)[:5]"
    )
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    run = subprocess.run(
        [sys.executable, "-c", code, str(SIM.parent)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]


def test_eight_nodes_name_a_crash_and_a_lost_node_and_all_restart(tmp_path):
    tag = uuid.uuid4().hex
    out = tmp_path / "sim.json"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, TAG_ENV: tag}
    try:
        run = subprocess.run(
            [
                sys.executable,
                str(SIM),
                "--nodes",
                str(NODES),
                "--cases",
                "crash,lost",
                "--steady-s",
                "2",
                "--fault-step",
                "12",
                "--timeout-s",
                "90",
                "--json",
                str(out),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=220,
        )
        print(run.stdout)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        document = json.loads(out.read_text())
        cases = {c["case"]: c for c in document["cases"]}
        assert sorted(cases) == ["crash", "lost"]
        for case in cases.values():
            assert case["error"] is None, case["error"]
            assert case["culprit_ok"], case["incident"]
            assert case["restarted_nodes"] == NODES
            assert case["exit_codes"] == {str(n): 0 for n in range(NODES)}
            assert case["left_running"] == []
            assert case["steady"]["requests_per_node_s"] > 0
        assert cases["crash"]["incident"]["culprit"]["rank"] == NODES - 1
        assert cases["lost"]["incident"]["culprit"]["node"] == NODES - 1
        assert cases["lost"]["incident"]["culprit"]["rank"] is None
        assert document["left_running"] == []
    finally:
        left = tagged(tag)
        for line in left:
            psutil.Process(int(line.split()[0])).kill()
    assert not left, f"processes left behind: {left}"
