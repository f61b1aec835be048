"""Staged healthy checkpoints in one process: background write, rollback from RAM, the bound."""

import logging
import threading
import time

import torch
import torch.distributed.checkpoint as dcp
from support.models import TINY, TinyGPT, random_batches

import torchvitals
from torchvitals.agent.recover.snapshot import restore, stage

BATCHES = list(random_batches(60, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))


def run(tmp_path, name, nan_at=27, steps=40, before_step=None, **config):
    """Train ``steps`` steps with a NaN once at ``nan_at``; count disk loads; return the
    reports, the final weights, the disk loads and the agent (closed). ``before_step(agent)``
    is called before each step."""
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    agent = torchvitals.watch(
        model,
        opt,
        sched,
        checkpoint_dir=str(tmp_path / name),
        checkpoint_every=10,
        healthy_window=5,
        **config,
    )
    loads, real = [0], dcp.load

    def counting(*args, **kwargs):
        loads[0] += 1
        return real(*args, **kwargs)

    dcp.load = counting
    reports, fired = [], False
    try:
        for x, y in agent.batches(BATCHES):
            loss = model.loss(x, y)
            if agent.step_count + 1 == nan_at and not fired:
                fired, loss = True, loss * float("nan")
            loss.backward()
            if before_step is not None:
                before_step(agent)
            reports.append(agent.step(loss))
            opt.zero_grad(set_to_none=True)
            if agent.step_count >= steps:
                break
        agent.close()
    finally:
        dcp.load = real
    return reports, {k: v.clone() for k, v in model.state_dict().items()}, loads[0], agent


def test_rollback_from_memory_lands_on_the_weights_a_disk_rollback_gives(tmp_path):
    reports, weights, loads, agent = run(tmp_path, "staged")
    sync_reports, sync_weights, sync_loads, _ = run(tmp_path, "sync", snapshot_max_bytes=0)
    rollbacks = [(r.step, r.rollback.to_step) for r in reports if r.action == "rollback"]
    assert (
        rollbacks
        == [(27, 20)]
        == [(r.step, r.rollback.to_step) for r in sync_reports if r.action == "rollback"]
    )
    assert loads == 0 and sync_loads == 1, (loads, sync_loads)
    assert all(torch.equal(weights[k], sync_weights[k]) for k in weights)
    # Every staged save was committed (at a later step, or at close for the last one).
    staged = [r.step for r in reports if r.checkpoint.saved]
    committed = [r.checkpoint.committed for r in reports if r.checkpoint.committed]
    assert committed == staged[: len(committed)] and agent.watchdog.last_healthy == staged[-1]
    assert (tmp_path / "staged" / f"step-{staged[-1]:08d}").is_dir()


def test_a_state_over_the_bound_is_saved_synchronously_and_logged_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        reports, _, loads, agent = run(tmp_path, "small", snapshot_max_bytes=1000)
    assert loads == 1, "the rollback must read the disk"
    assert not any(r.checkpoint.committed for r in reports), "synchronous saves settle nothing"
    assert agent.watchdog.staged.memory is None
    assert sum("exceed snapshot_max_bytes" in m for m in caplog.messages) == 1, caplog.messages


def test_the_step_returns_while_the_write_is_blocked(tmp_path):
    """The write runs in its own thread: hold DCP's write until the training went on."""
    gate, real = threading.Event(), dcp.save
    seen = []

    def held(*args, **kwargs):
        seen.append(threading.current_thread().name)
        assert gate.wait(60), "never released"
        return real(*args, **kwargs)

    dcp.save = held
    try:
        torch.manual_seed(0)
        model = TinyGPT(**TINY)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        agent = torchvitals.watch(
            model, opt, checkpoint_dir=str(tmp_path / "c"), checkpoint_every=3, healthy_window=0
        )
        reports = []
        for x, y in BATCHES[:5]:  # one save, at step 3; steps 4 and 5 go on
            loss = model.loss(x, y)
            loss.backward()
            reports.append(agent.step(loss))
            opt.zero_grad(set_to_none=True)
        assert [r.checkpoint.saved for r in reports] == [False, False, True, False, False]
        assert not any(r.checkpoint.committed for r in reports), "committed before the write"
        assert agent.watchdog.staged.in_flight and agent.watchdog.last_healthy is None
        gate.set()
        agent.close()  # completes the write in flight and commits it
    finally:
        gate.set()
        dcp.save = real
    assert seen and seen[0].startswith("torchvitals-checkpoint-"), seen
    assert agent.watchdog.last_healthy == 3 and (tmp_path / "c" / "step-00000003").is_dir()


def test_a_snapshot_is_a_copy_restored_as_often_as_needed():
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = BATCHES[0]
    model.loss(x, y).backward()
    opt.step()
    snap = stage(1, model, opt, None, extra={"position": 1}, rank_state=None)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):  # training must not write into the snapshot
        for _ in range(3):
            opt.zero_grad()
            model.loss(x, y).backward()
            opt.step()
        assert not torch.equal(model.state_dict()["lm_head.weight"], saved["lm_head.weight"])
        assert restore(snap, model, opt, None).extra == {"position": 1}
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    reused = stage(2, model, opt, None, extra={}, rank_state=None, into=snap)
    assert reused.tensors["model"]["lm_head.weight"] is snap.tensors["model"]["lm_head.weight"]


def test_a_copy_in_memory_that_does_not_come_back_as_saved_is_read_from_disk(tmp_path):
    """One bit of the copy of step 20 held in RAM flips after its write landed on disk (host
    memory corruption): the rollback at 27 finds the restored weights' fingerprint is not the
    one taken at the save, reads step 20 from disk instead, and ends on exactly the weights a
    rollback from disk gives."""
    flipped = []

    def flip(agent):
        dog = agent.watchdog
        if flipped or dog.rollbacks:
            return
        if agent.step_count == 24:  # let step 20's background write land first
            deadline = time.monotonic() + 60
            while dog.saver.flags() != [1.0, 0.0] and time.monotonic() < deadline:
                time.sleep(0.01)
        memory = dog.saver.memory
        if memory is None or memory.step != 20 or dog.last_healthy != 20:
            return  # committed at the step after the write landed
        weight = next(t for t in memory.tensors["model"].values() if t.dtype == torch.float32)
        weight.view(torch.int32).view(-1)[0] ^= 1 << 20  # one mantissa bit
        flipped.append(agent.step_count)

    reports, weights, loads, _ = run(tmp_path, "flipped", before_step=flip)
    _, sync_weights, _, _ = run(tmp_path, "sync", snapshot_max_bytes=0)
    assert flipped and flipped[0] < 27, flipped
    assert [(r.step, r.rollback.to_step) for r in reports if r.action == "rollback"] == [(27, 20)]
    assert loads == 1  # the disk copy, after the one in memory failed its check
    assert all(torch.equal(weights[k], sync_weights[k]) for k in weights)
