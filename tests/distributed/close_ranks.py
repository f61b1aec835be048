"""A peer lost while a background checkpoint is written, run on every rank of a spawned gloo
world (see test_close_bound.py). Rank 0 returns plain data for the parent to assert on; rank 1
never returns: it ends or stops its own process inside its write.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from recovery_ranks import WATCH, build, dataset, describe, forward_loss

import torchvitals
from torchvitals.agent.recover import checkpoint

STEPS = 10
EVERY = 5
"""Healthy checkpoints at steps 5 and 10: step 5's is committed before step 10's write starts
(a due save first settles the one in flight), and step 10's is the last step's, in flight when
the loop ends."""


class _Lines(logging.Handler):
    """The torchvitals log lines of this process at ERROR and above."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _lose_myself_in_write(step: int, signum: int) -> threading.Event:
    """Send ``signum`` to this process from inside its write of ``step``, once its rank files
    are written and before its shards: the peers' writes then wait on it in DCP's collectives.

    Returns:
        An event never set: the process ends (SIGKILL) or stops (SIGSTOP) before it could be.
    """
    real = checkpoint.write_shards
    name = f".tmp-step-{step:08d}"

    def write_shards(tmp: Path, tensors: Any, ranks: Any) -> None:
        if Path(tmp).name == name:
            os.kill(os.getpid(), signum)
        real(tmp, tensors, ranks)

    checkpoint.write_shards = write_shards  # this rank's process only
    return threading.Event()


def peer_lost_mid_save(
    rank: int, world: int, root: str, how: str, bound: float
) -> dict[str, Any] | None:
    """10 batches, healthy checkpoints every 5 steps written in the background, ``close()``
    bounded by ``bound`` seconds. Rank 1 sends itself ``how`` ("kill": SIGKILL, a dead peer;
    "stop": SIGSTOP, a hung host) inside its write of step 10 and never reaches ``close()``;
    rank 0 closes its agent with that write in flight and reports what it saw."""
    lines = _Lines()
    logging.getLogger("torchvitals").addHandler(lines)
    lost = None
    if rank == 1:
        lost = _lose_myself_in_write(STEPS, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    model, opt, sched = build("ddp", world)
    config = dict(WATCH, checkpoint_every=EVERY, checkpoint_close_timeout_s=bound)
    agent = torchvitals.watch(model, opt, sched, checkpoint_dir=root, **config)
    reports = []
    for _, x, y in agent.batches(dataset("ddp", STEPS, rank)):
        loss = forward_loss(model, x, y)
        loss.backward()
        reports.append(describe(agent.step(loss)))
        opt.zero_grad(set_to_none=True)
    if lost is not None:
        lost.wait(timeout=300)  # the process ends or stops in its write thread first
        raise AssertionError("rank 1 was still running 300 s after its last step")
    in_flight = agent.watchdog.saver.pending_step
    start = time.perf_counter()
    agent.close()
    seconds = time.perf_counter() - start
    ledger = json.loads((Path(root) / "ledger.json").read_text())
    return {
        "reports": reports,
        "in_flight": in_flight,
        "close_seconds": seconds,
        "errors": lines.lines,
        "last_healthy": agent.watchdog.last_healthy,
        "ledger_checkpoints": [e["step"] for e in ledger["entries"] if e["event"] == "checkpoint"],
        "folders": sorted(os.listdir(root)),
        "root": root,
        # What the interpreter's exit joins: the write thread must not be one of them.
        "held_threads": [
            t.name
            for t in threading.enumerate()
            if t.is_alive() and not t.daemon and t is not threading.main_thread()
        ],
    }
