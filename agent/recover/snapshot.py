"""The last healthy state of one rank, staged in host memory: what a rollback restores from RAM
and what the background checkpoint write reads.

    snap = stage(step, model, optimizer, scheduler, extra={...}, rank_state=None)  # the stall
    restore(snap, model, optimizer, scheduler)      # a memory copy back, no disk read

A snapshot holds this rank's own shards only (its DTensor local shards under FSDP2, the whole
replica under DDP), the optimizer state, the scheduler's state, this rank's RNG states, the
caller's ``extra`` (data position, LR scale) and ``rank_state`` (a stateful loader's). The
tensors are host copies (pinned when the source is on an accelerator, so the device-to-host copy
runs at full bandwidth), never views of the live ones: training goes on while the copy is
written, and a rollback can restore the same snapshot more than once.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..compat.pytorch import copy_state_dict, create_cpu_state_dict
from .rng import rng_state, set_rng_state
from .state import get_states, set_states


@dataclass
class Snapshot:
    """One rank's staged state of a healthy step."""

    step: int
    tensors: dict[str, Any]
    """``{"model": ..., "optim": ...}`` as ``get_state_dict`` shapes them, on the host."""
    scheduler: dict[str, Any] | None
    rng: dict[str, Any]
    extra: dict[str, Any]
    rank_state: dict[str, Any] | None
    nbytes: int
    stage_seconds: float = 0.0
    """How long staging stalled training (the device-to-host copy and the small state)."""


@dataclass
class Restored:
    """What a restore brought back: from disk (``CheckpointStore.load``) or RAM (``restore``)."""

    step: int
    """The healthy step the state is from."""
    path: Path | None
    """The checkpoint folder read; None when restored from host memory."""
    extra: dict[str, Any]
    """The caller's JSON state saved with it (data position, LR scale, ...)."""
    rank_state: dict[str, Any] | None
    """This rank's own state (a stateful loader's); None when none was saved or the world size
    changed."""
    refused: list[tuple[Path, str]] = field(default_factory=list)
    """Newer checkpoint folders refused on the way, with the reason."""


def live_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model", "optim"}`` state dicts whose tensors are the live ones (no copy)."""
    model_sd, optim_sd = get_states(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def state_bytes(tensors: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in a state dict (local shards for DTensors)."""
    return sum(t.numel() * t.element_size() for t in _tensors(tensors))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested state dict, a DTensor as its local shard."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def stage(
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any],
    rank_state: dict[str, Any] | None,
    into: Snapshot | None = None,
) -> Snapshot:
    """Copy this rank's state into host memory; the only part of a save that stalls training.

    Args:
        step: the healthy step it holds.
        model, optimizer, scheduler: the live objects (scheduler may be None).
        extra: JSON-able state of the caller, kept as it is (a deep copy).
        rank_state: JSON-able state of this rank alone, or None.
        into: a snapshot that is no longer needed: its host buffers are reused when the state
            has the same structure (no allocation, no page faults on the second save).

    Returns:
        The Snapshot.
    """
    start = time.perf_counter()
    live = live_tensors(model, optimizer)
    on_device = _any_accelerator(live)
    buffers = None
    if into is not None:
        try:
            buffers = copy_state_dict(live, into.tensors, non_blocking=on_device)
        except Exception:
            buffers = None  # (a new param group, new optimizer state): allocate anew
    if buffers is None:
        buffers = copy_state_dict(
            live, create_cpu_state_dict(live, pin_memory=on_device), non_blocking=on_device
        )
    if on_device:
        torch.cuda.synchronize()  # the non_blocking copies must land before anyone reads them
    return Snapshot(
        step=step,
        tensors=buffers,
        scheduler=None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
        rng=rng_state(),
        extra=copy.deepcopy(extra),
        rank_state=copy.deepcopy(rank_state),
        nbytes=state_bytes(buffers),
        stage_seconds=time.perf_counter() - start,
    )


def restore(
    snap: Snapshot, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> Restored:
    """Bring model, optimizer, scheduler and this rank's RNG states back to ``snap``, in place.

    The live tensors are overwritten from the host copy (the disk path does the same: DCP loads
    into the live state dict, then ``set_state_dict``), so the snapshot stays intact for a
    later rollback to it. Not collective: every rank restores its own shards.

    Returns:
        What was restored, like ``CheckpointStore.load`` (``path`` None: no disk read).
    """
    live = live_tensors(model, optimizer)
    on_device = _any_accelerator(live)
    restored = copy_state_dict(snap.tensors, live, non_blocking=on_device)
    if on_device:
        torch.cuda.synchronize()
    set_states(model, optimizer, restored["model"], restored["optim"])
    if scheduler is not None and snap.scheduler is not None:
        scheduler.load_state_dict(copy.deepcopy(snap.scheduler))
    set_rng_state(snap.rng)
    return Restored(
        step=snap.step,
        path=None,
        extra=copy.deepcopy(snap.extra),
        rank_state=copy.deepcopy(snap.rank_state),
    )


def _any_accelerator(tensors: dict[str, Any]) -> bool:
    return any(t.device.type == "cuda" for t in _tensors(tensors))
