"""Background checkpoints and decisions at more ranks, run on every rank of a spawned gloo world
(see test_async_checkpoint.py). Each returns plain data for the parent to assert on.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from recovery_ranks import WATCH, build, dataset, describe, forward_loss, params

import torchvitals


def _count_disk_loads() -> list[int]:
    """Count ``dcp.load`` calls in this process: a rollback from memory makes none."""
    calls = [0]
    real = dcp.load

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    dcp.load = counting
    return calls


def write_fails_on_rank1(rank: int, world: int, root: str) -> dict[str, Any]:
    """60 batches, a healthy checkpoint every 10 steps, written in the background. From the
    first commit on, rank 1's disk is "full" (RLIMIT_FSIZE 1 kB: EFBIG, as ENOSPC; it stops root
    too) until a report says a write failed; rank 1's loss is NaN at step 45 (once). Expected:
    one failed save, reported on both ranks at the same step, training goes on, the rollback at
    45 restores the last committed step from memory (no disk read), and later saves commit."""
    data = dataset("ddp", 60, rank)
    model, opt, sched = build("ddp", world)
    torch.manual_seed(1000 + rank)
    loads = _count_disk_loads()
    agent = torchvitals.watch(model, opt, sched, checkpoint_dir=root, **WATCH)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.getsignal(signal.SIGXFSZ)
    state = "before"
    reports = []
    injected = False
    for _, x, y in agent.batches(data):
        step = agent.step_count + 1
        loss = forward_loss(model, x, y)
        if rank == 1 and step == 45 and not injected:
            injected = True
            loss = loss * float("nan")
        loss.backward()
        report = agent.step(loss)
        opt.zero_grad(set_to_none=True)
        reports.append(describe(report))
        if state == "before" and report.checkpoint.committed is not None:
            state = "full"
            if rank == 1:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us
                resource.setrlimit(resource.RLIMIT_FSIZE, (1_000, hard))
        elif state == "full" and report.checkpoint.failed is not None:
            state = "after"
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)
    failures = agent.watchdog.metrics()["checkpoint_failures"]
    agent.close()
    return {
        "reports": reports,
        "disk_loads": loads[0],
        "failures": failures,
        "folders": sorted(os.listdir(root)),
    }


def decisions_at_scale(rank: int, world: int, root: str) -> dict[str, Any]:
    """24 batches on every rank of a larger world, healthy checkpoints every 4 steps in the
    background. Rank 5's loss is NaN at step 10 (once); rank 6 stalls 0.3 s in its data loading
    on every step numbered 9 or more (a straggler, from before the rollback on). Every rank must
    roll back and name rank 6 in the same step, commit the same checkpoints in the same steps,
    and end with the same weights."""
    data = dataset("ddp", 24, rank)
    model, opt, sched = build("ddp", world)
    torch.manual_seed(1000 + rank)
    loads = _count_disk_loads()
    agent = torchvitals.watch(
        model,
        opt,
        sched,
        checkpoint_dir=root,
        **dict(WATCH, checkpoint_every=4, trust_steps=1),  # the NaN at 10: back to 8
    )
    reports = []
    injected = False
    for _, x, y in agent.batches(data):
        step = agent.step_count + 1
        if rank == 6 and step >= 9:
            time.sleep(0.3)
        loss = forward_loss(model, x, y)
        if rank == 5 and step == 10 and not injected:
            injected = True
            loss = loss * float("nan")
        loss.backward()
        report = agent.step(loss)
        opt.zero_grad(set_to_none=True)
        reports.append(
            dict(
                describe(report),
                stragglers=[
                    v.evidence["rank"] for v in report.verdicts if v.pattern == "straggler"
                ],
            )
        )
    agent.close()
    final = params(model)
    checksum = float(sum(p.double().sum() for p in final.values()))
    return {"reports": reports, "disk_loads": loads[0], "checksum": checksum}
