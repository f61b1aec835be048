"""Per-block gradient norms: this rank's sums of squares, one SUM, a square root per block.

The gradients are measured when the step runs, or earlier when something is about to change
them in place (a framework's clipping calls ``capture`` first): the report's norms are then the
pre-clip ones. A capture whose gradients are gone by the step (a new backward pass: the loop
skipped that step itself) is dropped, never reported as this step's.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..detect.observed import Observed
from ..guard import ClipWatch, same_tensors
from ..measure.reduce import Packer, Reduced, Slot
from ..measure.stats import GradStats
from ..report import Report
from .base import Signal, StepContext


class GradNorms(Signal):
    """Args:
        stats: this rank's share of the per-block squared norms.
        names: the block names.
        device: where the sums are accumulated.
        probe: the guard's probe gradients (tells one backward pass from the next).
        clip_watch: warns when the norms look clipped before they were measured.
    """

    rules = ("NonFinite", "BlockNorms", "Vanishing", "DeadPipeline")
    metrics = ("torchvitals_grad_norm", "torchvitals_grad_norm_global",
               "torchvitals_clip_coefficient")

    def __init__(self, stats: GradStats, names: list[str], device: torch.device,
                 probe: Callable[[], list[Any]], clip_watch: ClipWatch) -> None:
        self.stats, self.names, self.device = stats, names, device
        self._probe, self._clip_watch = probe, clip_watch
        self._captured: torch.Tensor | None = None
        self._captured_from: list[Any] = []     # the gradients it was measured from

    def capture(self) -> None:
        """Measure the gradients now, before something changes them in place."""
        now = self._probe()
        if self._captured is not None and not same_tensors(now, self._captured_from):
            self._captured = None     # a new backward since: the loop skipped that step itself
        if self._captured is None:
            self._captured, self._captured_from = self.stats.block_sq(self.device), now

    def pack(self, ctx: StepContext, packer: Packer) -> Slot:
        captured, self._captured = self._captured, None
        if captured is not None and not same_tensors(self._probe(), self._captured_from):
            captured = None           # measured before a step the loop then left out
        self._captured_from = []
        return packer.add_sum(captured if captured is not None else self.stats.block_sq(ctx.device))

    def unpack(self, ctx: StepContext, handle: Slot, reduced: Reduced, report: Report,
               seen: Observed) -> None:
        grad_sq = reduced[handle]
        report.grad_norm = {n: math.sqrt(v) for n, v in zip(self.names, grad_sq)}
        report.grad_norm_total = math.sqrt(sum(grad_sq))
        report.nonfinite_grad = not math.isfinite(report.grad_norm_total)
        self._clip_watch.observe(report)
