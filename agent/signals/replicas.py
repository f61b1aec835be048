"""Replica fingerprints: DDP replicas whose parameters silently diverged, on sampled steps.

Only a DDP module's replicas are compared (an FSDP2 module's shards are not replicas, and a
plain module in a world may differ on purpose). The fingerprints ride the MAX vector; the only
extra collective runs in the step where replicas were seen to differ, to name the ranks, and
every rank reaches it in the same step since the reduced vector is identical on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..detect.observed import Observed
from ..measure.fingerprint import Fingerprint
from ..measure.reduce import Packer, Reduced, Slot
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup


class Replicas(Signal):
    rules = ("ReplicaDivergence",)
    metrics = ("torchvitals_replica_checks_total",)
    fills = ("replicas.checked", "replicas.mismatch")

    def __init__(
        self,
        fingerprint: Fingerprint,
        group: dist.ProcessGroup | None,
        collective_device: torch.device,
    ) -> None:
        self.fingerprint, self.group = fingerprint, group
        self._collective_device = collective_device

    def pack(self, ctx: StepContext, packer: Packer) -> Slot | None:
        if not ctx.sampled:
            return None
        return packer.add_max(self.fingerprint.pack(ctx.device))

    def unpack(
        self,
        ctx: StepContext,
        handle: Slot | None,
        reduced: Reduced,
        report: Report,
        seen: Observed,
    ) -> None:
        if handle is None:
            return
        report.replicas.checked = True
        mismatched = self.fingerprint.mismatched(reduced[handle])
        if mismatched:
            report.replicas.mismatch = self.fingerprint.name_ranks(
                mismatched, self.group, ctx.world_size, self._collective_device
            )


def build(setup: Setup) -> Replicas | None:
    """DDP replicas are fingerprinted; FSDP2 shards and plain modules are not replicas."""
    if not (isinstance(setup.model, DistributedDataParallel) and setup.world_size > 1):
        return None
    return Replicas(Fingerprint(setup.blocks), setup.group, setup.collective_device)
