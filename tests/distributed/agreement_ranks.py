"""What each rank of the watch() agreement tests runs: a rank that differs from the others (its
environment, a port taken on its node, its own folder, its own group), then watch(), then a
barrier on the job's group, which proves no rank was left inside a collective of watch().

Each returns ``(error type, message, cause type)`` (``("", "watch() returned", "")`` when it
returned), so the parent compares the ranks' errors.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from support.models import TINY, TinyGPT
from torch.nn.parallel import DistributedDataParallel

import torchvitals

QUIET: dict[str, Any] = {"log_dir": "", "metrics_port": 0}


def _outcome(watch: Callable[[], Any]) -> tuple[str, str, str]:
    try:
        agent = watch()
    except torchvitals.TorchvitalsError as error:
        outcome = (type(error).__name__, str(error), type(error.__cause__).__name__)
    else:
        agent.close()
        outcome = ("", "watch() returned", "")
    dist.barrier()  # every rank is here: none was left waiting in a collective of watch()
    return outcome


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def sample_every_differs(rank: int, world: int) -> tuple[str, str, str]:
    """One node's environment sets another sampling rate."""
    os.environ["TORCHVITALS_SAMPLE_EVERY"] = "3" if rank == 1 else "10"
    model, opt = _model()
    return _outcome(lambda: torchvitals.watch(model, opt, **QUIET))


def port_taken_on_one_rank(rank: int, world: int, base: int) -> tuple[str, str, str]:
    """Rank 1's node already serves something on its /metrics port, and the port is strict."""
    held = socket.socket()
    if rank == 1:
        held.bind(("127.0.0.1", base + 1))
        held.listen()
    try:
        model, opt = _model()
        return _outcome(
            lambda: torchvitals.watch(
                model, opt, log_dir="", metrics_port=base, metrics_port_strict=True
            )
        )
    finally:
        held.close()


def bad_signal_on_one_rank(rank: int, world: int) -> tuple[str, str, str]:
    """Rank 1 fails in the last part of watch(), after every collective of it: the others must
    not return and step into a reduction it never joins."""
    model, opt = _model()
    signals: list[Any] = ["not a signal"] if rank == 1 else []
    return _outcome(lambda: torchvitals.watch(model, opt, signals=signals, **QUIET))


def folder_per_rank(rank: int, world: int, root: str) -> tuple[str, str, str]:
    """Each rank's checkpoint folder is its own (node-local disks mounted at one path)."""
    model, opt = _model()
    folder = os.path.join(root, f"node-{rank}")
    return _outcome(lambda: torchvitals.watch(model, opt, checkpoint_dir=folder, **QUIET))


def two_trainings(rank: int, world: int, explicit: bool) -> tuple[str, str, str]:
    """Two DDP groups, {0, 1} and {2, 3}, each training its own copy in one job: watched with
    each group's ``group=`` or with none."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    torch.manual_seed(rank // 2)
    model = DistributedDataParallel(TinyGPT(**TINY), process_group=mine)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    group = {"group": mine} if explicit else {}
    return _outcome(lambda: torchvitals.watch(model, opt, **group, **QUIET))


def world_group(rank: int, world: int) -> dict[str, Any]:
    """A gloo group over the whole world passed as ``group=``: taken; its ranks are the global
    ranks, and global rank 0 alone writes the event log."""
    group = dist.new_group(list(range(world)), backend="gloo")
    model, opt = _model()
    agent = torchvitals.watch(model, opt, group=group, metrics_port=0, log_dir=os.environ["LOGS"])
    try:
        for _ in range(2):
            x = torch.randint(0, TINY["vocab"], (2, TINY["seq_len"]))
            model(x).float().mean().backward()
            agent.step()
            opt.zero_grad(set_to_none=True)
        return {
            "global_rank": agent.global_rank,
            "group_rank": agent._group_rank,
            "run_dir": agent.run_dir,
            "writes_records": agent._incidents is not None,
        }
    finally:
        agent.close()
