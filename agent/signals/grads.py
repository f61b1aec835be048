"""Per-block gradient norms: this rank's sums of squares, one SUM, a square root per block.

The gradients are measured when the step runs, or earlier when something is about to change
them in place (a framework's clipping calls ``capture`` first): the report's norms are then the
pre-clip ones. A capture whose gradients are gone by the step (a new backward pass: the loop
skipped that step itself) is dropped, never reported as this step's.

A block none of whose gradients any rank could read (``param.grad`` None and no framework
partition holding one) is reported as missing: its norm is NaN and it is named in
``grad_norm_missing``, never a 0 that would read as a dead layer. How many gradient tensors
each rank read rides the same SUM (host counts, no sync). A model where no parameter got a
gradient at all from ``param.grad`` is the exception: the backward pass reached none (a
detached graph), its gradient is exactly zero, and ``dead_pipeline`` says so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ..detect.observed import Observed
from ..detect.wiring import unstepped
from ..guard import ClipWatch, same_tensors
from ..measure.reduce import Packer, Reduced, Slot
from ..measure.stats import GradStats
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GradSlots:
    sq: Slot
    """Per-block sums of squared norms."""
    read: Slot
    """Per-block counts of the gradient tensors the ranks read, then per block how many ranks
    expect one (a pipeline's ranks know only their own stage's blocks)."""


def unread_blocks(read: list[float], expected: list[bool], partitioned: bool) -> list[int]:
    """The blocks whose gradient no rank could read this step.

    Args:
        read: per block, the gradient tensors read summed over the ranks.
        expected: per block, whether it has a trainable parameter the optimizer steps (a frozen
            block's gradient is absent by design: it stays 0, and the wiring check names it).
        partitioned: the gradients come from a framework's partitions, not ``param.grad``.

    Returns:
        Block indices, in order. None at all read from ``param.grad``: the backward pass
        reached no parameter, a gradient of exactly zero, so no block is missing.
    """
    if not partitioned and not any(read):
        return []
    return [b for b, (n, e) in enumerate(zip(read, expected)) if e and n == 0]


class GradNorms(Signal):
    """Args:
    stats: this rank's share of the per-block squared norms.
    names: the block names.
    device: where the sums are accumulated.
    probe: the guard's probe gradients (tells one backward pass from the next).
    clip_watch: warns when the norms look clipped before they were measured.
    expected: per block, whether it has a trainable parameter the optimizer steps (all
        True when None).
    log: where the one warning naming missing blocks goes (None: not on this rank).
    """

    rules = ("NonFinite", "BlockNorms", "GradSpike", "Vanishing", "DeadPipeline")
    fills = ("grad_norm", "grad_norm_total", "grad_norm_missing", "nonfinite_grad")
    metrics = (
        "torchvitals_grad_norm",
        "torchvitals_grad_norm_global",
        "torchvitals_clip_coefficient",
    )

    def __init__(
        self,
        stats: GradStats,
        names: list[str],
        device: torch.device,
        probe: Callable[[], list[Any]],
        clip_watch: ClipWatch,
        expected: list[bool] | None = None,
        log: Any = None,
    ) -> None:
        self.stats, self.names, self.device = stats, names, device
        self._probe, self._clip_watch = probe, clip_watch
        self._expecting = [
            1.0 if e else 0.0 for e in ([True] * len(names) if expected is None else expected)
        ]
        self._log = log
        self._warned: set[str] = set()
        self._captured: tuple[torch.Tensor, list[float]] | None = None
        self._captured_from: list[Any] = []  # the gradients it was measured from

    def capture(self) -> None:
        """Measure the gradients now, before something changes them in place."""
        now = self._probe()
        if self._captured is not None and not same_tensors(now, self._captured_from):
            self._captured = None  # a new backward since: the loop skipped that step itself
        if self._captured is None:
            self._captured, self._captured_from = self.stats.measure(self.device), now

    def pack(self, ctx: StepContext, packer: Packer) -> GradSlots:
        captured, self._captured = self._captured, None
        if captured is not None and not same_tensors(self._probe(), self._captured_from):
            captured = None  # measured before a step the loop then left out
        self._captured_from = []
        sq, read = captured if captured is not None else self.stats.measure(ctx.device)
        return GradSlots(packer.add_sum(sq), packer.add_host_sum(list(read) + self._expecting))

    def unpack(
        self, ctx: StepContext, handle: GradSlots, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        grad_sq = reduced[handle.sq]
        counts, n = reduced[handle.read], len(self.names)
        missing = set(
            unread_blocks(counts[:n], [e > 0 for e in counts[n:]], self.stats.partitioned)
        )
        report.grad_norm = {
            n: math.nan if b in missing else math.sqrt(v)
            for b, (n, v) in enumerate(zip(self.names, grad_sq))
        }
        measured = [v for b, v in enumerate(grad_sq) if b not in missing]
        total = sum(measured)
        report.grad_norm_total = math.sqrt(total) if measured else math.nan
        report.grad_norm_missing = [self.names[b] for b in sorted(missing)]
        report.nonfinite_grad = not math.isfinite(total)
        if missing:
            self._warn(report)
        self._clip_watch.observe(report)

    def _warn(self, report: Report) -> None:
        new = [b for b in report.grad_norm_missing if b not in self._warned]
        if not new:
            return
        self._warned.update(new)
        if self._log is not None:
            self._log.warning(
                "torchvitals: no rank could read a gradient of block(s) %s at step %d "
                "(param.grad is None and no framework partition holds one: bypassed in the "
                "forward pass, or gradients kept where torchvitals does not read them): their "
                "grad norms are reported as missing (NaN), not 0, and no dead_pipeline or "
                "vanishing_gradients verdict is drawn from them",
                ", ".join(new),
                report.step,
            )


def build(setup: Setup) -> GradNorms:
    """Every run measures the gradients; only rank 0 logs (missing blocks, a clipped look)."""
    blocks, here = setup.blocks, log if setup.rank == 0 else None
    return GradNorms(
        GradStats(blocks, setup.owned(), setup.world_size, setup.split, setup.grad_source),
        blocks.names,
        setup.device,
        setup.probe_grads,
        ClipWatch(log=here),
        expected=[sum(map(len, unstepped(ps, setup.stepped))) < len(ps) for ps in blocks.params],
        log=here,
    )
