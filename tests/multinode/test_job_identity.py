"""One job identity: the ledger records the job, the same job continues its folder after any
kind of restart, another job is refused with both ids, and the refusal is final for the
supervisor.

    python -m pytest tests/multinode/test_job_identity.py
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from support.models import TINY, TinyGPT, random_batches

import torchvitals
from torchvitals import protocol
from torchvitals.agent.recover.watchdog import ResumeRefused
from torchvitals.records.jobid import job_identity, launcher_job_id, resume_decision
from torchvitals.records.ledger import LedgerError
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.supervisor import Supervisor

BATCHES = list(random_batches(6, batch=2, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))
RESTART_VARS = (protocol.ATTEMPT_ENV, "TORCHELASTIC_RESTART_COUNT", *protocol.JOB_ID_ENVS)


@pytest.fixture(autouse=True)
def no_inherited_ids(monkeypatch):
    for name in RESTART_VARS:
        monkeypatch.delenv(name, raising=False)


def run(ckpt, steps=4, **kwargs):
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torchvitals.watch(
        model, opt, checkpoint_dir=str(ckpt), checkpoint_every=2, healthy_window=0, **kwargs
    ) as agent:
        for x, y in BATCHES[:steps]:
            loss = model.loss(x, y)
            loss.backward()
            agent.step(loss)
            opt.zero_grad(set_to_none=True)
        return agent.resumed_from


def test_the_ids_of_the_launchers_and_schedulers_first_set_wins():
    assert job_identity({}) is None
    assert job_identity({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's unnamed default
    assert job_identity({"SLURM_JOB_ID": "4711", "TORCHELASTIC_RUN_ID": "rdzv"}) == "rdzv"
    assert job_identity({"SLURM_JOB_ID": "4711", protocol.JOB_ID_ENV: "mine"}) == "mine"
    assert launcher_job_id(["torchrun", "--rdzv-id", "j7", "t.py"]) == "j7"
    assert launcher_job_id(["torchrun", "--rdzv_id=j8", "t.py"]) == "j8"
    assert launcher_job_id(["torchrun", "--rdzv-id=none", "t.py"]) is None
    assert resume_decision(None, "a") == resume_decision("a", None)
    assert not resume_decision(None, "a").refuse and not resume_decision(None, "a").same_job


def test_the_same_job_continues_its_folder_after_a_restart_no_counter_saw(tmp_path, monkeypatch):
    # torchrun's elastic restart on a surviving node (TORCHELASTIC_RESTART_COUNT stays 0), a
    # Slurm requeue, a replaced pod: nothing counts a restart, the job id is the same.
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert run(tmp_path / "ckpt") is None
    assert json.loads((tmp_path / "ckpt" / "ledger.json").read_text())["job_id"] == "4711"
    assert run(tmp_path / "ckpt") == 4


def test_another_job_is_refused_naming_both_ids_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.JOB_ID_ENV, "job-a")
    run(tmp_path / "ckpt")
    monkeypatch.setenv(protocol.JOB_ID_ENV, "job-b")
    monkeypatch.setenv(protocol.ATTEMPT_ENV, "2")  # even as a supervisor's restart
    beats = tmp_path / "hb"
    with pytest.raises(ResumeRefused) as refused:
        run(tmp_path / "ckpt", heartbeat_dir=str(beats))
    message = str(refused.value)
    assert "'job-a'" in message and "'job-b'" in message and "new checkpoint_dir" in message
    assert protocol.read_heartbeats(beats).refused
    # resume="auto" takes the folder over, and it is job-b's from then on.
    assert run(tmp_path / "ckpt", resume="auto") == 4
    assert json.loads((tmp_path / "ckpt" / "ledger.json").read_text())["job_id"] == "job-b"


def test_a_corrupt_ledger_is_a_refusal_the_supervisor_never_retries(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.JOB_ID_ENV, "job-a")
    run(tmp_path / "ckpt")
    ledger = tmp_path / "ckpt" / "ledger.json"
    torn = ledger.read_text()[:-40]  # a torn write
    ledger.write_text(torn)
    beats = tmp_path / "hb"
    with pytest.raises(LedgerError, match="corrupt"):
        run(tmp_path / "ckpt", heartbeat_dir=str(beats))
    assert protocol.read_heartbeats(beats).refused  # so the supervisor exits 78 at once
    assert ledger.read_text() == torn  # left as it was, for a person to look


REFUSING_JOB = """
import os, sys
from torchvitals.agent.recover.heartbeat import Heartbeat
Heartbeat(os.environ["TORCHVITALS_HEARTBEAT_DIR"], 0).beat(0, "refused")
with open(sys.argv[1], "a") as f:
    f.write(os.environ["TORCHVITALS_JOB_ID"] + "\\n")
sys.exit(1)
"""


def test_a_refusal_is_final_for_the_supervisor(tmp_path):
    script = tmp_path / "refuses.py"
    script.write_text(REFUSING_JOB)
    config = SupervisorConfig(
        backoff_s=0.05, grace_s=1, poll_s=0.05, heartbeat_root=str(tmp_path / "hb")
    )
    supervisor = Supervisor(config, [sys.executable, str(script), str(tmp_path / "runs")])
    assert supervisor.run() == protocol.REFUSED_EXIT_CODE == 78
    # Once, never retried; every attempt of one supervisor is one job (an id made for it).
    ran = (tmp_path / "runs").read_text().split()
    assert len(ran) == 1 and ran[0] == supervisor.job_id and len(ran[0]) == 32
    assert [a.reason for a in supervisor.history] == ["exit"]
