"""Pack a step's statistics into one SUM vector (and, on sampled steps, one MAX vector), reduce
them across ranks, and bring the result to the host in one copy; each signal reads its slots
back (``agent/signals/``).

At most two collectives per step whatever the model size: the SUM part always, the MAX part only
when there is something to take the maximum of (activation abs_max, on sampled steps). Every rank
decides the layout from the same deterministic schedule, so the collectives always match.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

F64 = torch.float64


@dataclass(eq=False)
class Slot:
    """A handle to one packed quantity: where it lands in the reduced host vector.

    ``Packer.add_*`` returns it; its position is fixed when the packer builds the vectors, and
    ``Reduced[slot]`` reads it back. Handles instead of names: a signal keeps the slots it
    packed, so nothing is addressed by a string on either side of the reduction.
    """

    length: int
    start: int = -1

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass
class Reduced:
    """The step's reduced values on the host, in one list (the one device-to-host copy)."""

    host: list[float]
    sum_len: int
    """Floats in the SUM vector (host values first, then device values)."""
    max_len: int
    """Floats in the MAX vector (0 on steps without one)."""

    def __getitem__(self, slot: Slot) -> list[float]:
        return self.host[slot.start : slot.stop]

    def scalar(self, slot: Slot) -> float:
        return self.host[slot.start]


class Packer:
    """Collects device tensors (1-D, float64) and host floats into the packed vectors; each
    ``add_*`` returns the ``Slot`` its values are read back from."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sum: list[tuple[Slot, torch.Tensor]] = []
        self._max: list[tuple[Slot, torch.Tensor]] = []
        self._local: list[tuple[Slot, torch.Tensor]] = []
        self._host: list[tuple[Slot, list[float]]] = []

    def add_sum(self, t: torch.Tensor) -> Slot:
        """Device values summed over the ranks."""
        return self._add(self._sum, t.reshape(-1).to(F64))

    def add_host_sum(self, values: Sequence[float]) -> Slot:
        """Host values that every rank needs (step times, counts): copied without a sync."""
        return self._add(self._host, [float(v) for v in values])

    def add_max(self, t: torch.Tensor) -> Slot:
        """Device values whose maximum over the ranks is wanted (sampled steps)."""
        return self._add(self._max, t.reshape(-1).to(F64))

    def add_local(self, t: torch.Tensor) -> Slot:
        """Device values wanted on the host as they are on this rank (not reduced)."""
        return self._add(self._local, t.reshape(-1).to(F64))

    @staticmethod
    def _add(into: list[tuple[Slot, Any]], values: Any) -> Slot:
        slot = Slot(len(values) if isinstance(values, list) else values.numel())
        into.append((slot, values))
        return slot

    def build(self) -> tuple[int, int, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Place every slot; return ``(sum_len, max_len, sum, max or None, local)``."""
        parts, pos = [], 0
        host_values = [v for _, values in self._host for v in values]
        if host_values:
            host = torch.tensor(host_values, dtype=F64)
            if self.device.type != "cpu":
                # Pinned + non_blocking: a pageable host-to-device copy would wait for the stream.
                host = host.pin_memory().to(self.device, non_blocking=True)
            parts.append(host)
        for slot, _ in self._host:
            slot.start, pos = pos, pos + slot.length
        for slot, t in self._sum:
            parts.append(t)
            slot.start, pos = pos, pos + slot.length
        sum_len = pos
        sum_vec = torch.cat(parts) if parts else torch.zeros(0, dtype=F64, device=self.device)
        max_vec = None
        if self._max:
            max_vec = torch.cat([t for _, t in self._max])
            for slot, _ in self._max:
                slot.start, pos = pos, pos + slot.length
        max_len = pos - sum_len
        for slot, _ in self._local:
            slot.start, pos = pos, pos + slot.length
        local_vec = (
            torch.cat([t for _, t in self._local])
            if self._local
            else torch.zeros(0, dtype=F64, device=self.device)
        )
        return sum_len, max_len, sum_vec, max_vec, local_vec


# A collective launched during backward (DDP's bucket all-reduce) captures the autograd engine's
# thread-local Python context; the backend's worker thread drops that work, and with it a Python
# object, just after the work completes. If the interpreter is already finalizing by then, taking
# the GIL ends that C++ thread mid-destructor and the process dies with SIGABRT ("terminate called
# without an active exception", about 1 exit in 8 of a 2-rank gloo DDP job on CPU, with or
# without torchvitals). atexit runs before finalization: releasing the GIL there for a moment lets
# those worker threads finish their release first.
EXIT_DRAIN_S = 0.05
_drain_registered = False


def drain_collectives_at_exit() -> None:
    """Once per process: at exit, release the GIL briefly so finished collectives are freed."""
    global _drain_registered
    if not _drain_registered:
        atexit.register(time.sleep, EXIT_DRAIN_S)
        _drain_registered = True


class Reducer:
    """Runs the (at most two) collectives and the one device-to-host copy."""

    def __init__(self, group: dist.ProcessGroup | None, world_size: int):
        self.group = group
        self.world_size = world_size
        self.collectives = 0
        backend = dist.get_backend(group) if world_size > 1 else None
        # gloo reduces host tensors: move the packed vectors to the host first (that copy is the
        # step's one device-to-host copy); NCCL reduces on the device, then copies once.
        self._host_collectives = backend is not None and "nccl" not in str(backend)
        self.device_collectives = backend is not None and not self._host_collectives
        if backend is not None:
            drain_collectives_at_exit()

    def reduce(self, packer: Packer) -> Reduced:
        """Run the step's collectives over ``packer``'s vectors; one copy to the host."""
        sum_len, max_len, sum_vec, max_vec, local_vec = packer.build()
        if self.world_size == 1:
            parts = [sum_vec] + ([max_vec] if max_vec is not None else []) + [local_vec]
            return Reduced(torch.cat(parts).tolist(), sum_len, max_len)
        if self._host_collectives and sum_vec.device.type != "cpu":
            parts = [sum_vec] + ([max_vec] if max_vec is not None else []) + [local_vec]
            flat = torch.cat(parts).cpu()
            sum_vec = flat[:sum_len].clone()
            max_vec = flat[sum_len : sum_len + max_len].clone() if max_vec is not None else None
            local_vec = flat[sum_len + max_len :]
        dist.all_reduce(sum_vec, op=dist.ReduceOp.SUM, group=self.group)
        self.collectives += 1
        if max_vec is not None:
            dist.all_reduce(max_vec, op=dist.ReduceOp.MAX, group=self.group)
            self.collectives += 1
        parts = [sum_vec] + ([max_vec] if max_vec is not None else []) + [local_vec]
        return Reduced(torch.cat(parts).tolist(), sum_len, max_len)
