"""The commands as a user runs them, each in a fresh process: preflight on a factory named on the
command line, the torch-free commands where torch cannot be imported, and every command's
--help explaining its flags.

    python -m pytest tests/integration/test_commands.py
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchvitals
from torchvitals.collector.config import CollectorConfig
from torchvitals.settings import field_docs
from torchvitals.supervisor.options import SECRET_FIELDS, SupervisorConfig

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The folder holding the support package, which ``preflight`` imports its factory from."""


def test_cli_preflight(tmp_path):
    png = tmp_path / "lr.png"
    env = dict(os.environ, TORCHVITALS_PREFLIGHT_LR_STEPS="40", OMP_NUM_THREADS="1")
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchvitals",
            "preflight",
            "support.preflight_factories:healthy",
            "--steps",
            "200",
            "--png",
            str(png),
        ],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("preflight: PASSED") and png.stat().st_size > 0


NO_TORCH = (
    """raise ImportError("torch is not importable in this test: the command must not need it")\n"""
)


def _without_torch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``python -m <args>`` where ``import torch`` raises."""
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True, exist_ok=True)
    (shadow / "torch" / "__init__.py").write_text(NO_TORCH)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )


def _a_real_run(tmp_path: Path) -> Path:
    """A short real run's folder (event log and ledger), written by the agent here, with torch."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = torchvitals.watch(
        model,
        opt,
        log_dir=str(tmp_path / "runs"),
        run_name="r",
        checkpoint_dir=str(tmp_path / "runs" / "r" / "ckpt"),
        checkpoint_every=5,
        metrics_port=0,
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        x = torch.randn(16, 4, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        agent.step(loss)
        opt.zero_grad()
    agent.close()
    return tmp_path / "runs" / "r"


def test_the_torch_free_commands_run_where_torch_cannot_be_imported(tmp_path):
    assert "must not need it" in _without_torch(tmp_path, "torchvitals.agent.agent").stderr
    run = _a_real_run(tmp_path)
    for args, expect in [
        (("torchvitals", "supervise", "--help"), "--hang-timeout-s"),
        (("torchvitals.collector", "--help"), "--state-dir"),
        (("torchvitals", "diagnose", str(run / "events.jsonl")), "cause:"),
        (("torchvitals", "report", str(run)), "report.html"),
        (("torchvitals", "report", str(run), "--job-dir", str(run / "ckpt")), "report.html"),
    ]:
        out = _without_torch(tmp_path, *args)
        assert out.returncode == 0 and expect in out.stdout, (args, out.stderr[-2000:])
    assert (run / "loss.png").is_file()


LOADED = """
import sys
from torchvitals.__main__ import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("LOADED", " ".join(sorted(sys.modules)))
"""


@pytest.mark.parametrize(
    "argv",
    [("incidents", "JOB"), ("goodput", "JOB"), ("supervise", "--help")],
    ids=["incidents", "goodput", "supervise"],
)
def test_the_commands_on_a_jobs_records_load_neither_torch_the_agent_nor_the_collector(
    argv, tmp_path
):
    """What runs on every node (the supervisor) and what a person runs on a login node over a
    job's folder loads the records and the supervisor's own modules, nothing of the training
    side or the webhook service."""
    job = tmp_path / "job"
    for kind in ("incidents", "goodput"):
        (job / kind).mkdir(parents=True)
    args = [str(job) if a == "JOB" else a for a in argv]
    out = subprocess.run(
        [sys.executable, "-c", LOADED, *args], capture_output=True, text=True, timeout=120
    )
    loaded = next(
        (line.split()[1:] for line in out.stdout.splitlines() if line.startswith("LOADED")), None
    )
    assert loaded is not None, out.stdout[-2000:] + out.stderr[-2000:]
    unwanted = [
        m
        for m in loaded
        if m == "torch" or m.startswith(("torch.", "torchvitals.agent", "torchvitals.collector"))
    ]
    assert not unwanted, (argv, unwanted)
    assert "torchvitals.records" in loaded, loaded


@pytest.mark.parametrize(
    "cls, argv",
    [
        (SupervisorConfig, ["torchvitals", "supervise", "--help"]),
        (CollectorConfig, ["torchvitals.collector", "--help"]),
    ],
)
def test_every_flag_says_what_it_does_and_its_default(cls, argv):
    out = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in ("webhook_token", "job_tokens", *SECRET_FIELDS):  # never a flag: ps shows it
            assert "--" + f.name.replace("_", "-") + " " not in text
            continue
        assert "--" + f.name.replace("_", "-") in text
        first_words = " ".join(docs[f.name].split()[:4])
        assert first_words in text, (f.name, first_words)
        default = "none" if f.default is None else str(f.default)
        assert f"(default: {default};" in text, (f.name, default)
