"""What a built-in signal is built from at ``watch()``: the agent's collaborators ready by then.

    signal = factory(setup)      # each signal module's ``build``; None: not on this run

``agent.py`` fills one ``Setup`` after the ranks agreed on the blocks and the guard, watchdog
and poller exist, and hands it to every factory in ``registry.BUILTIN``, in order. A factory
reads only what it needs; none holds the record, so nothing of the agent stays reachable from
a signal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import Config
from ..detect.thresholds import Thresholds
from ..measure.blocks import Blocks
from ..measure.datawait import DataWait
from ..measure.stages import Agreed
from ..recover.directives import DirectivePoller
from ..recover.watchdog import Watchdog


@dataclasses.dataclass(frozen=True)
class Setup:
    """The inputs of the built-in signal factories (built once per ``watch()``)."""

    config: Config
    layout: Agreed
    """The blocks every rank packs, and this rank's pipeline stage."""
    model: nn.Module
    """The watched model (DDP's wrapper included: replicas are fingerprinted only under DDP)."""
    params: list[torch.Tensor]
    """The watched parameters, in block order."""
    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    device: torch.device
    """Where the packed device values live."""
    collective_device: torch.device
    """Where an extra collective's tensors go (the device under NCCL, else the host)."""
    thresholds: Thresholds
    loss_level: Callable[[], tuple[float, float] | None]
    """The loss rule's (median, threshold) at the last judged step (``Detector.loss_level``)."""
    probe_grads: Callable[[], list[Any]]
    """The guard's probe gradients: tells one backward pass from the next."""
    grad_source: Callable[[torch.Tensor], torch.Tensor | None] | None
    """Where gradients are read when not from ``param.grad`` (a framework's partitions)."""
    param_source: Callable[[torch.Tensor], torch.Tensor] | None
    """Where this rank's values of a parameter are read when it is not whole on every rank."""
    stepped: Any
    """What holds the parameters a step updates, shaped as ``param_groups``."""
    data_wait: DataWait
    watchdog: Watchdog | None
    poller: DirectivePoller | None
    """Global rank 0's collector poller (None elsewhere and without a collector)."""

    @property
    def blocks(self) -> Blocks:
        return self.layout.blocks

    @property
    def dtensors(self) -> bool:
        """Some parameters are DTensors (FSDP2, HSDP, tensor parallelism)."""
        return any(isinstance(p, DTensor) for p in self.params)

    @property
    def split(self) -> bool:
        """Under DDP each block's replicas split the measuring work (one of them measures it)."""
        return self.config.split_ddp_work and self.world_size > 1 and not self.dtensors

    def owned(self) -> list[bool]:
        """Per block, whether this rank measures it (every block unless the work is split)."""
        split = self.split
        return [
            bool(h) and h[b % len(h)] == self.rank if split else True
            for b, h in enumerate(self.blocks.holders)
        ]
