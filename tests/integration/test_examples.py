"""The examples run: the quickstart prints its per-block signals, and the plain, fp16, DDP and
FSDP2 (torchrun, 2 CPU ranks), Lightning, Hugging Face Trainer and nanoGPT-shaped examples train
a few steps under the agent."""

import os
import subprocess
import sys

import pytest
from support.world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_prints_per_block_signals_and_writes_its_event_log(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "quickstart.py"),
            "--steps",
            "12",
            "--metrics-port",
            "0",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "step   10" in out and "step   12" in out
    for block in ("tok_emb", "blocks.0", "blocks.3", "lm_head"):
        assert any(line.split()[:1] == [block] for line in out.splitlines()), f"no row for {block}"
    logs = list(tmp_path.glob("torchvitals_runs/*/events.jsonl"))
    assert len(logs) == 1 and len(logs[0].read_text().splitlines()) == 12


def _run_example(args: list[str], tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    env.update(
        TORCHVITALS_METRICS_PORT="0",
        TORCHVITALS_LOG_DIR="",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
    )
    proc = subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("name", ["plain", "fp16"])
def test_single_process_examples_train_under_the_agent(name, tmp_path):
    out = _run_example([os.path.join(ROOT, "examples", f"{name}.py"), "--steps", "4"], tmp_path)
    assert "step 4 loss" in out, out
    if name == "fp16":
        assert "loss_scale 65536" in out, out  # the scaler went through the agent


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_torchrun_examples_train_two_ranks_under_the_agent(name, tmp_path):
    out = _run_example(
        [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            os.path.join(ROOT, "examples", f"{name}.py"),
            "--steps",
            "4",
        ],
        tmp_path,
    )
    # Printed by rank 0 only; every block of the 2-layer GPT measured (tok, pos, 2 blocks,
    # head, other).
    assert out.count("step 4 loss") == 1 and "blocks 6" in out, out


@pytest.mark.parametrize(
    "name, expected",
    [
        pytest.param("lightning_ddp", "step 6: loss", marks=pytest.mark.frameworks),
        pytest.param("hf_trainer", "step 6: loss", marks=pytest.mark.frameworks),
        ("nanogpt_loop", "6 iterations, model step 6"),
    ],
)
def test_framework_and_nanogpt_examples_run_as_shown(name, expected, tmp_path):
    flag = "--max-iters" if name == "nanogpt_loop" else "--steps"
    out = _run_example(
        [os.path.join(ROOT, "examples", f"{name}.py"), flag, "6", "--out", str(tmp_path / "run")],
        tmp_path,
    )
    assert expected in out, out
