"""The step's non-numeric vitals in the reduction: data wait, memory, replica fingerprints.

    vitals = StepVitals(model, blocks, device, group, reducer, clock)
    vitals.pack(packer, step_seconds, sampled=True)      # before the reduction
    vitals.unpack(layout, host, report)                  # after it: fills the report's fields

Every step adds two host floats to the SUM vector (this rank's data wait and step time, so the
job's data-wait share is known on every rank; a straggler's own wait rides its flag, see
``detect/straggler.py``). Sampled steps add to the MAX vector the rank's resident and accelerator memory (the
rank nearest to running out) and, under DDP, the replica fingerprints. Nothing here syncs the
device; the only extra collective runs in the step where replicas were seen to differ.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..report import Report
from .blocks import Blocks
from .datawait import DataWait
from .fingerprint import Fingerprint
from .host import MemorySample
from .reduce import Layout, Packer, Reducer


class StepVitals:
    """Packs and unpacks the vitals of one rank's steps.

    Args:
        model: the watched model; a DDP module's replicas are fingerprinted (an FSDP2 module's
            shards are not replicas, and a plain module in a world may differ on purpose).
        blocks: the model's blocks (for the fingerprints).
        device: the rank's device.
        group: the reduction's process group (None in one process).
        reducer: the step's reducer (its world size, and where its collectives run).
        clock: the agent's clock, for the data wait.
    """

    def __init__(self, model: nn.Module, blocks: Blocks, device: torch.device,
                 group: dist.ProcessGroup | None, reducer: Reducer, clock: Callable[[], float]):
        self.device, self.group, self.world_size = device, group, reducer.world_size
        self.rank = dist.get_rank(group) if reducer.world_size > 1 else 0
        self.wait = DataWait(clock)
        self.memory = MemorySample(device)
        replicas = isinstance(model, DistributedDataParallel) and self.world_size > 1
        self.fingerprint = Fingerprint(blocks) if replicas else None
        self._collective_device = device if reducer.device_collectives else torch.device("cpu")
        self._wait = 0.0

    def pack(self, packer: Packer, step_seconds: float, *, sampled: bool) -> None:
        """Add this step's vitals to ``packer``.

        Args:
            packer: the step's packer.
            step_seconds: this rank's step time.
            sampled: a sampled step (memory and fingerprints ride its MAX vector).
        """
        self._wait = self.wait.take()
        packer.add_host_sum("data_wait", [self._wait, step_seconds])
        if sampled:
            packer.add_max("memory", _to_device(self.memory.read(), packer.device))
            if self.fingerprint is not None:
                packer.add_max("replica_fp", self.fingerprint.pack(packer.device))

    def unpack(self, layout: Layout, host: list[float], report: Report) -> dict[str, Any]:
        """Fill ``report``'s vitals from the reduced vector; return the detector's extras.

        Runs the naming collective when the fingerprints differ: every rank reaches that
        branch in the same step, since the reduced vector is identical on every rank.
        """
        wait_sum, step_sum = layout.get(host, "data_wait")
        report.local_data_wait_seconds = self._wait
        report.data_wait_mean_seconds = wait_sum / self.world_size
        report.data_wait_ratio = wait_sum / step_sum if step_sum > 0 else 0.0
        extra: dict[str, Any] = {}
        if "memory" in layout:
            report.memory = MemorySample.unpack(layout.get(host, "memory"),
                                                accelerator=self.device.type == "cuda")
        report.local_accelerator_memory = self.memory.accelerator     # kept from the last sample
        if "replica_fp" in layout:
            report.replicas_checked = True
            mismatched = self.fingerprint.mismatched(layout.get(host, "replica_fp"))
            if mismatched:
                report.replica_mismatch = self.fingerprint.name_ranks(
                    mismatched, self.group, self.world_size, self._collective_device)
        return extra


def _to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host floats as a float64 tensor on ``device`` without making the host wait for it."""
    host = torch.tensor(values, dtype=torch.float64)
    if device.type == "cpu":
        return host
    # Pinned + non_blocking: a pageable host-to-device copy would wait for the stream.
    return host.pin_memory().to(device, non_blocking=True)
