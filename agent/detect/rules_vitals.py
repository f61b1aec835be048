"""The fingerprints of the failures that are not numeric: a leak, a starving loader, replicas
that silently diverged.

Like every rule (see ``rules``), each judges the reduced, rank-identical report only, so every
rank names the same verdict in the same step.
"""

from __future__ import annotations

from collections import deque
from itertools import pairwise

from ..report import Report
from .rules import Rule
from .thresholds import Thresholds
from .verdict import CRITICAL, DATA_STALL, MEMORY_GROWTH, REPLICA_DIVERGENCE, WARNING, Verdict


class MemoryGrowth(Rule):
    """Resident or accelerator memory rising sample after sample: the leak that ends in OOM."""

    patterns = (MEMORY_GROWTH,)

    def __init__(self, t: Thresholds):
        self.t = t
        self.series: dict[str, deque[tuple[int, float]]] = {}

    def observe(self, report: Report, seen):
        if not report.memory:
            return None
        found = []
        samples = self.t.memory_growth_samples + 1
        for key, value in report.memory.items():
            series = self.series.setdefault(key, deque(maxlen=samples))
            if report.step <= self.t.warmup_steps:
                continue
            series.append((report.step, value))
            if len(series) < samples:
                continue
            values = [v for _, v in series]
            rise = values[-1] - values[0]
            steady = all(b > a for a, b in pairwise(values))
            if (
                steady
                and rise >= self.t.memory_growth_min_bytes
                and rise >= self.t.memory_growth_min_ratio * values[0]
            ):
                steps = series[-1][0] - series[0][0]
                found.append(
                    Verdict(
                        MEMORY_GROWTH,
                        WARNING,
                        report.step,
                        None,
                        {
                            "memory": key,
                            "bytes": value,
                            "first_bytes": values[0],
                            "rise_bytes": rise,
                            "bytes_per_step": rise / steps if steps > 0 else rise,
                            "samples": len(values) - 1,
                            "from_step": series[0][0],
                            "fired": "memory_growth_min_bytes",
                            "memory_growth_min_bytes": self.t.memory_growth_min_bytes,
                            "memory_growth_samples": self.t.memory_growth_samples,
                        },
                    )
                )
        return found


class DataStall(Rule):
    """The ranks spend most of each step waiting for their batches."""

    patterns = (DATA_STALL,)

    def __init__(self, t: Thresholds):
        self.t = t
        self.run = 0

    def observe(self, report: Report, seen):
        if report.step <= self.t.warmup_steps:
            return []
        stalled = (
            report.timing.data_wait_ratio >= self.t.data_stall_ratio
            and report.timing.data_wait_mean_seconds >= self.t.data_stall_min_seconds
        )
        self.run = self.run + 1 if stalled else 0
        if self.run >= self.t.data_stall_steps:
            return [
                Verdict(
                    DATA_STALL,
                    WARNING,
                    report.step,
                    None,
                    {
                        "data_wait_ratio": report.timing.data_wait_ratio,
                        "data_wait_seconds": report.timing.data_wait_mean_seconds,
                        "steps": self.run,
                        "fired": "data_stall_ratio",
                        "data_stall_ratio": self.t.data_stall_ratio,
                    },
                )
            ]
        return []


class ReplicaDivergence(Rule):
    """DDP replicas whose parameters are no longer bitwise identical (silent data corruption)."""

    patterns = (REPLICA_DIVERGENCE,)

    def __init__(self, t: Thresholds):
        self.t = t
        self.run = 0

    def observe(self, report: Report, seen):
        if not report.replicas.checked:
            return None
        self.run = self.run + 1 if report.replicas.mismatch else 0
        if self.run < self.t.replica_mismatch_samples:
            return []
        blocks = report.replicas.mismatch
        ranks = sorted({r for rs in blocks.values() for r in rs})
        return [
            Verdict(
                REPLICA_DIVERGENCE,
                CRITICAL,
                report.step,
                next(iter(blocks)),
                {
                    "blocks": blocks,
                    "ranks": ranks,
                    "samples": self.run,
                    "fired": "replica_mismatch_samples",
                    "replica_mismatch_samples": self.t.replica_mismatch_samples,
                },
            )
        ]


def make_vital_rules(t: Thresholds) -> list[Rule]:
    """The rules of this module, in the order the detector runs them."""
    return [ReplicaDivergence(t), MemoryGrowth(t), DataStall(t)]
