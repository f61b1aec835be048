"""The watchdog's public API in one process: the exception users catch, the agent without a
checkpoint folder, the heartbeat. (A fault that persists after every rollback:
test_watchdog.py.)"""

from __future__ import annotations

import torch
from support.models import TINY, TinyGPT, random_batches

import torchvitals

BATCHES = list(random_batches(60, batch=8, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))


def _setup(**config):
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.02 * s))
    return (
        model,
        opt,
        sched,
        torchvitals.watch(model, opt, sched, metrics_port=0, log_dir="", **config),
    )


def test_training_aborted_is_exported_and_a_system_exit():
    assert hasattr(torchvitals, "TrainingAborted"), "torchvitals.TrainingAborted is not exported"
    assert issubclass(torchvitals.TrainingAborted, SystemExit)
    assert torchvitals.TrainingAborted(75).code == 75


def test_without_checkpoint_dir_there_is_no_watchdog():
    model, opt, _sched, agent = _setup()
    seen, actions = [], []
    for step, (x, y) in enumerate(agent.batches(BATCHES[:12]), start=1):
        seen.append(step)
        loss = model.loss(x, y)
        if step == 5:
            loss = loss * float("nan")
        loss.backward()
        actions.append(agent.step(loss).action)
        opt.zero_grad(set_to_none=True)
    agent.close()
    assert seen == list(range(1, 13))
    assert actions == ["step"] * 4 + ["skip"] + ["step"] * 7  # today's behaviour
    assert agent.resumed_from is None and agent.lr_scale == 1.0 and agent.skipped_batches == []


def test_heartbeat_reports_progress_and_checkpoint_phases(tmp_path):
    import json as _json

    from torchvitals.agent.recover.heartbeat import Heartbeat

    clock = [100.0]
    beat = Heartbeat(tmp_path, rank=3, interval_s=1.0, clock=lambda: clock[0])
    read = lambda: _json.loads((tmp_path / "heartbeat-rank00003.json").read_text())  # noqa: E731
    beat.beat(1)
    assert read()["step"] == 1 and read()["phase"] == "train" and read()["rank"] == 3
    beat.beat(2)  # within interval_s: not written again
    assert read()["step"] == 1
    beat.beat(phase="checkpoint")  # a phase change is written at once
    assert read()["phase"] == "checkpoint" and read()["step"] == 2
    clock[0] += 1.5
    beat.beat(7, "train")
    assert read() == {"step": 7, "time": 101.5, "phase": "train", "pid": read()["pid"], "rank": 3}
