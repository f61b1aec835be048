"""Memory: the rank nearest to running out, on sampled steps (the leak that ends in OOM).

Each sampled step adds this rank's resident (and, on CUDA, allocated) bytes to the MAX vector;
``local_accelerator_memory`` keeps this rank's own reading of the last sample.
"""

from __future__ import annotations

import torch

from ..detect.observed import Observed
from ..measure.host import MemorySample
from ..measure.reduce import Packer, Reduced, Slot
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup


class Memory(Signal):
    rules = ("MemoryGrowth",)
    metrics = (
        "torchvitals_process_resident_memory_bytes",
        "torchvitals_accelerator_memory_allocated_bytes",
        "torchvitals_accelerator_memory_reserved_bytes",
        "torchvitals_accelerator_memory_peak_bytes",
        "torchvitals_accelerator_memory_fragmentation_bytes",
    )
    fills = ("memory", "local.accelerator_memory")

    def __init__(self, sample: MemorySample) -> None:
        self.sample = sample

    def pack(self, ctx: StepContext, packer: Packer) -> Slot | None:
        if not ctx.sampled:
            return None
        return packer.add_max(to_device(self.sample.read(), ctx.device))

    def unpack(
        self,
        ctx: StepContext,
        handle: Slot | None,
        reduced: Reduced,
        report: Report,
        seen: Observed,
    ) -> None:
        if handle is not None:
            report.memory = MemorySample.unpack(
                reduced[handle], accelerator=ctx.device.type == "cuda"
            )
        report.local.accelerator_memory = self.sample.accelerator  # kept from the last sample


def build(setup: Setup) -> Memory:
    return Memory(MemorySample(setup.device))


def to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host floats as a float64 tensor on ``device`` without making the host wait for it."""
    host = torch.tensor(values, dtype=torch.float64)
    if device.type == "cpu":
        return host
    # Pinned + non_blocking: a pageable host-to-device copy would wait for the stream.
    return host.pin_memory().to(device, non_blocking=True)
