"""What a supervisor of one node of several needs, refused at start when missing: a store, a
node rank inside the job, one job id; the node rank comes from the scheduler when not given.

    python -m pytest tests/multinode/test_multinode_config.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchvitals.supervisor.options import SupervisorConfig, node_rank

PYTHONPATH = os.pathsep.join(
    p for p in (str(Path(__file__).resolve().parents[2].parent), os.environ.get("PYTHONPATH")) if p
)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"nnodes": 2}, "needs store_url"),
        ({"nnodes": 2, "store_url": "http://127.0.0.1:1", "node_rank": 2}, "node_rank < nnodes"),
        ({"refused_exit_code": 76}, "exit codes must differ"),
        ({"node_ttl_s": 0}, "node_ttl_s must be > 0"),
    ],
)
def test_a_node_without_what_it_needs_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SupervisorConfig(**fields)


def test_the_node_rank_is_the_schedulers_when_not_given():
    config = SupervisorConfig(nnodes=4, store_url="http://127.0.0.1:1")
    assert node_rank(config, {"SLURM_NODEID": "3"}) == 3
    assert node_rank(config, {"PET_NODE_RANK": "1"}) == 1
    assert node_rank(config, {}) == 0
    assert (
        node_rank(
            SupervisorConfig(nnodes=4, store_url="http://x", node_rank=2), {"SLURM_NODEID": "3"}
        )
        == 2
    )
    with pytest.raises(ValueError, match="SLURM_NODEID='7'"):
        node_rank(config, {"SLURM_NODEID": "7"})


def test_several_nodes_without_a_job_id_do_not_start():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TORCHVITALS_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchvitals",
            "supervise",
            "--nnodes",
            "2",
            "--store-url",
            "http://127.0.0.1:9",
            "--",
            sys.executable,
            "-c",
            "1",
        ],
        env={**env, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "needs one job id on every node" in run.stderr
