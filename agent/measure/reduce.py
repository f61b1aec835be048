"""Pack a step's statistics into one SUM vector (and, on sampled steps, one MAX vector), reduce
them across ranks, bring the result to the host in one copy, and unpack it into the Report.

At most two collectives per step whatever the model size: the SUM part always, the MAX part only
when there is something to take the maximum of (activation abs_max, on sampled steps). Every rank
decides the layout from the same deterministic schedule, so the collectives always match.
"""

from __future__ import annotations

import atexit
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .activations import summarize
from ..report import Report

F64 = torch.float64


@dataclass
class Layout:
    """Where each quantity sits in the reduced host vector."""

    sections: dict[str, tuple[int, int]]
    sum_len: int
    max_len: int

    def get(self, host: list[float], name: str) -> list[float]:
        start, stop = self.sections[name]
        return host[start:stop]

    def __contains__(self, name: str) -> bool:
        return name in self.sections


class Packer:
    """Collects named device tensors (1-D, float64) and host floats into the packed vectors."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sum: list[tuple[str, torch.Tensor]] = []
        self._max: list[tuple[str, torch.Tensor]] = []
        self._local: list[tuple[str, torch.Tensor]] = []
        self._host: list[tuple[str, list[float]]] = []

    def add_sum(self, name: str, t: torch.Tensor) -> None:
        self._sum.append((name, t.reshape(-1).to(F64)))

    def add_host_sum(self, name: str, values: list[float]) -> None:
        """Host values that every rank needs (step times, counts): copied without a sync."""
        self._host.append((name, [float(v) for v in values]))

    def add_max(self, name: str, t: torch.Tensor) -> None:
        self._max.append((name, t.reshape(-1).to(F64)))

    def add_local(self, name: str, t: torch.Tensor) -> None:
        """Device values wanted on the host as they are on this rank (not reduced)."""
        self._local.append((name, t.reshape(-1).to(F64)))

    def build(self) -> tuple[Layout, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        sections, parts, pos = {}, [], 0
        host_values = [v for _, values in self._host for v in values]
        if host_values:
            host = torch.tensor(host_values, dtype=F64)
            if self.device.type != "cpu":
                # Pinned + non_blocking: a pageable host-to-device copy would wait for the stream.
                host = host.pin_memory().to(self.device, non_blocking=True)
        offset = 0
        for name, values in self._host:
            parts.append(host[offset:offset + len(values)])
            offset += len(values)
            sections[name] = (pos, pos + len(values))
            pos += len(values)
        for name, t in self._sum:
            parts.append(t)
            sections[name] = (pos, pos + t.numel())
            pos += t.numel()
        sum_len = pos
        sum_vec = torch.cat(parts) if parts else torch.zeros(0, dtype=F64, device=self.device)
        max_vec = None
        if self._max:
            max_vec = torch.cat([t for _, t in self._max])
            for name, t in self._max:
                sections[name] = (pos, pos + t.numel())
                pos += t.numel()
        max_len = pos - sum_len
        local_parts = []
        for name, t in self._local:
            local_parts.append(t)
            sections[name] = (pos, pos + t.numel())
            pos += t.numel()
        local_vec = torch.cat(local_parts) if local_parts else torch.zeros(0, dtype=F64, device=self.device)
        return Layout(sections, sum_len, max_len), sum_vec, max_vec, local_vec


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

    def reduce(self, packer: Packer) -> tuple[Layout, list[float]]:
        layout, sum_vec, max_vec, local_vec = packer.build()
        if self.world_size == 1:
            parts = [sum_vec] + ([max_vec] if max_vec is not None else []) + [local_vec]
            return layout, torch.cat(parts).tolist()
        if self._host_collectives and sum_vec.device.type != "cpu":
            parts = [sum_vec] + ([max_vec] if max_vec is not None else []) + [local_vec]
            flat = torch.cat(parts).cpu()
            sum_vec = flat[:layout.sum_len].clone()
            max_vec = flat[layout.sum_len:layout.sum_len + layout.max_len].clone() if max_vec is not None else None
            local_vec = flat[layout.sum_len + layout.max_len:]
        dist.all_reduce(sum_vec, op=dist.ReduceOp.SUM, group=self.group)
        self.collectives += 1
        if max_vec is not None:
            dist.all_reduce(max_vec, op=dist.ReduceOp.MAX, group=self.group)
            self.collectives += 1
        parts = [sum_vec] + ([max_vec] if max_vec is not None else []) + [local_vec]
        return layout, torch.cat(parts).tolist()


def unpack(layout: Layout, host: list[float], *, step: int, names: list[str], world_size: int,
           rank: int, pending: tuple[Any, Any, list[bool], int] | None) -> Report:
    """The step's Report from the reduced host vector (identical on every rank but local_*)."""
    grad_sq = layout.get(host, "grad_sq")
    loss_sum = layout.get(host, "loss")[0]
    known = layout.get(host, "loss_known")[0]     # ranks that knew their loss this step
    nonfinite_loss = layout.get(host, "loss_nonfinite")[0] > 0 or not math.isfinite(loss_sum)
    total = math.sqrt(sum(grad_sq))
    nonfinite_grad = not math.isfinite(total)
    report = Report(
        step=step, loss=loss_sum / known if known else math.nan,
        grad_norm={n: math.sqrt(v) for n, v in zip(names, grad_sq)},
        grad_norm_total=total, nonfinite=nonfinite_loss or nonfinite_grad,
        nonfinite_loss=nonfinite_loss, nonfinite_grad=nonfinite_grad,
        world_size=world_size, rank=rank,
        mean_step_seconds=layout.get(host, "rank_seconds")[0] / world_size,
        mean_compute_seconds=layout.get(host, "rank_seconds")[1] / world_size,
        local_loss=layout.get(host, "local_loss")[0])
    if pending is not None:
        d_sq, w_sq, chosen = layout.get(host, "update_dsq"), layout.get(host, "update_wsq"), pending[2]
        report.update_ratio = {n: _ratio(d, w) for n, d, w, c in zip(names, d_sq, w_sq, chosen) if c}
        report.update_ratio_step = pending[3]
    if "act_sums" in layout:
        counts, sums, maxes = (layout.get(host, "act_count"), layout.get(host, "act_sums"),
                               layout.get(host, "act_max"))
        report.activations = {n: summarize(counts[b], sums[5 * b:5 * b + 5], maxes[b])
                              for b, n in enumerate(names) if counts[b] > 0}
        attn, neg_entropy, logit = (layout.get(host, "attn_count"),
                                    layout.get(host, "attn_neg_entropy"), layout.get(host, "attn_logit"))
        for b, n in enumerate(names):
            if attn[b] > 0 and n in report.activations:
                report.activations[n]["attention_entropy"] = -neg_entropy[b]
                report.activations[n]["attention_logit_max"] = logit[b] if logit[b] > -math.inf else math.nan
    return report


def _ratio(d_sq: float, w_sq: float) -> float:
    if w_sq == 0:
        return 0.0 if d_sq == 0 else math.inf
    return math.sqrt(d_sq) / math.sqrt(w_sq)
