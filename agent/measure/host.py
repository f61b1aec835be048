"""Process, host and accelerator vitals of one rank, read from host counters (never a device sync).

    process_vitals()          # scrape time: resident memory, CPU time, fds, children, host
    accelerator_memory(dev)   # sampled steps: allocated, reserved, peak since the last call

The failures that end long runs are rarely numeric: a leak that ends in an out-of-memory kill
hours later, a loader whose workers died, a host running out of memory. ``process_vitals`` is
read by the exporter when Prometheus scrapes (on the scrape thread, never the training thread);
``MemorySample`` is read on sampled steps only, because detection needs the same numbers on
every rank, so they ride the step's reduction.
"""

from __future__ import annotations

import math
import os
from typing import Any

import psutil
import torch

ACCELERATOR_KEYS = ("allocated_bytes", "reserved_bytes", "peak_bytes", "fragmentation_bytes")


def process_vitals(proc: psutil.Process | None = None) -> dict[str, float]:
    """This process's and this host's vitals now (a few /proc reads, about 0.1-1 ms).

    Args:
        proc: the process to read (default: this one).

    Returns:
        ``resident_bytes``, ``cpu_seconds`` (user + system, for ``rate()``), ``open_fds``,
        ``children`` (live child processes: the DataLoader workers, and any other child),
        ``host_available_bytes``; a value that cannot be read is NaN.
    """
    proc = proc or psutil.Process()
    out = {
        "resident_bytes": math.nan,
        "cpu_seconds": math.nan,
        "open_fds": math.nan,
        "children": math.nan,
        "host_available_bytes": math.nan,
    }
    readers = {
        "resident_bytes": lambda: proc.memory_info().rss,
        "cpu_seconds": lambda: sum(proc.cpu_times()[:2]),
        "open_fds": proc.num_fds if hasattr(proc, "num_fds") else proc.num_handles,
        "children": lambda: sum(1 for c in proc.children() if c.is_running()),
        "host_available_bytes": lambda: psutil.virtual_memory().available,
    }
    for key, read in readers.items():
        try:
            out[key] = float(read())
        except (psutil.Error, OSError):  # a child that exited mid-read, a hardened /proc
            continue
    return out


def accelerator_memory(device: torch.device) -> dict[str, float] | None:
    """The CUDA caching allocator's counters for ``device``; None on a CPU device.

    Host counters only (``torch.cuda.memory_allocated`` and friends read the allocator's own
    bookkeeping), so no device sync. The peak is reset after reading: each call reports the
    peak since the previous one.

    Args:
        device: the rank's device.

    Returns:
        ``allocated_bytes``, ``reserved_bytes``, ``peak_bytes`` and ``fragmentation_bytes``
        (reserved but not allocated: what the allocator holds that tensors do not use).
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    allocated = float(torch.cuda.memory_allocated(device))
    reserved = float(torch.cuda.memory_reserved(device))
    peak = float(torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    return {
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "peak_bytes": peak,
        "fragmentation_bytes": reserved - allocated,
    }


class MemorySample:
    """What a sampled step packs for ``memory_growth``: this rank's resident and device memory.

    Packed into the MAX vector, so every rank judges the rank closest to running out.

    Args:
        device: the rank's device (CUDA counters are read when it is a CUDA device).
    """

    KEYS = ("resident_bytes", "accelerator_allocated_bytes")

    def __init__(self, device: torch.device):
        self.device = device
        self._proc = psutil.Process(os.getpid())
        self.accelerator: dict[str, float] | None = None
        """This rank's accelerator counters at the last ``read`` (None on CPU)."""

    def read(self) -> list[float]:
        """The values to MAX-reduce, in ``KEYS`` order (0 where there is no accelerator)."""
        try:
            rss = float(self._proc.memory_info().rss)
        except (psutil.Error, OSError):
            rss = 0.0
        self.accelerator = accelerator_memory(self.device)
        return [rss, self.accelerator["allocated_bytes"] if self.accelerator else 0.0]

    @staticmethod
    def unpack(values: list[float], accelerator: bool) -> dict[str, Any]:
        """The reduced values as the report's ``memory`` dict."""
        out = {"resident_bytes": values[0]}
        if accelerator:
            out["accelerator_allocated_bytes"] = values[1]
        return out
