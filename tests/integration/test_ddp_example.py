"""examples/ddp_train.py, the job the compose demo and the chart's PyTorchJob run, under torchrun.

Two gloo ranks train and checkpoint through the watchdog, configured by the environment alone
as the deployments configure them; a second run on the same checkpoint folder resumes.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(tmp_path: Path, steps: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    env.update(
        OMP_NUM_THREADS="1",
        TORCHVITALS_METRICS_PORT="0",
        TORCHVITALS_LOG_DIR="",
        TORCHVITALS_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        TORCHVITALS_CHECKPOINT_EVERY="5",
        TORCHVITALS_HEALTHY_WINDOW="2",
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "ddp_train.py"),
            "--steps",
            str(steps),
            "--batch",
            "4",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_ddp_example_trains_checkpoints_and_resumes(tmp_path):
    first = _torchrun(tmp_path, 20)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "step 20 loss" in first.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))[-1] == "step-00000020"
    second = _torchrun(tmp_path, 25)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from step 20" in second.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))[-1] == "step-00000025"
