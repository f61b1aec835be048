"""What each rank runs for test_incidents_ddp.py: DDP over two gloo ranks, rank 1's loss NaN at
a named step (once), a watchdog that rolls every rank back; each rank reports its actions, the
SUM payload's length at every step, who it is, and (rank 0) which incidents existed when each
step published."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
from support.models import TINY, TinyGPT, random_batches
from torch.nn.parallel import DistributedDataParallel

import torchvitals
from torchvitals.agent.outputs.sinks import Sink
from torchvitals.records.incidents import IncidentLog


class IncidentsAtPublish(Sink):
    """The incident keys in the job's folder when each step published (rank 0)."""

    def __init__(self, folder: str) -> None:
        self.log, self.seen = IncidentLog(folder), []

    def publish(self, report) -> None:
        self.seen.append((report.step, str(report.action), [i.key for i in self.log.read()[0]]))


def nan_on_rank1(rank: int, world: int, root: str, nan_step: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyGPT(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sink = IncidentsAtPublish(root)
    agent = torchvitals.watch(
        model,
        opt,
        checkpoint_dir=root,
        checkpoint_every=5,
        healthy_window=2,
        snapshot_max_bytes=0,
        log_dir="",
        metrics_port=0,
        sinks=[sink] if rank == 0 else [],
    )
    # Observe (not replace) the reduction: the SUM vector's length at each step.
    lengths: list[int] = []
    reduce = agent._reducer.reduce

    def measured(packer):
        reduced = reduce(packer)
        lengths.append(reduced.sum_len)
        return reduced

    agent._reducer.reduce = measured
    out: dict[str, Any] = {"actions": [], "pid": os.getpid(), "host": socket.gethostname()}
    injected = False
    try:
        data = random_batches(
            steps, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank
        )
        for x, y in data:
            step = agent.step_count + 1
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            )
            if rank == 1 and step == nan_step and not injected:
                injected = True
                loss = loss * float("nan")
            loss.backward()
            before = time.time()
            report = agent.step(loss)
            if step == nan_step and "window" not in out:
                out["window"] = (before, time.time())
            out["actions"].append((report.step, str(report.action), report.nonfinite_ranks))
            out.setdefault("sampled", []).append(bool(report.activations))
            opt.zero_grad(set_to_none=True)
    finally:
        agent.close()
    out["sum_len"] = lengths
    out["seen"] = sink.seen
    return out
