"""What a vital sign is to the step: a vertical slice that packs, reads back and is judged.

    class Memory(Signal):
        def pack(self, ctx, packer):             # measure: this rank's values, typed slots
            return packer.add_max(...) if ctx.sampled else None
        def unpack(self, ctx, handle, reduced, report, seen):   # after the one reduction
            report.memory = ...

Each signal of ``agent/signals/`` is one module: the local measurement it packs into the
step's one SUM vector (and, on sampled steps, the MAX vector), how it reads its slots back into
the Report (or, for what is not a report field, into ``Observed``, the rules' other input), and
the names of the rules that judge it and of the metric families that show it (the rules live in
``detect/``, the metric table in ``outputs/metrics.py``: each name is defined once there). The
step (``agent/step.py``) calls every signal in the same order on every rank, so the packed
layout, and with it the collectives, always match.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from ..detect.observed import Observed
from ..measure.reduce import Packer, Reduced
from ..report import Report


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What one step's signals know before the reduction; identical on every rank but the
    ``local`` times and the loss."""

    step: int
    """The step being measured (1-based)."""
    sampled: bool
    """A sampled step: activations were recorded, memory and replicas ride the MAX vector."""
    step_seconds: float
    """This rank's wall time since its previous step ended."""
    compute_seconds: float
    """This rank's time from its previous step's end to the end of its last forward pass."""
    loss: torch.Tensor | float | None
    """This rank's loss of the step (None: unknown, gradients only)."""
    scale: torch.Tensor | None
    """The loss scale of the enabled GradScaler the step goes through (a device tensor; the
    gradients are already unscaled), or None."""
    device: torch.device
    world_size: int
    rank: int


class Signal:
    """One vital sign. Subclasses implement ``pack`` and ``unpack``; the default packs nothing.

    Attributes:
        rules: the names of the ``detect`` rules that judge what this signal fills in.
        metrics: the metric families (``outputs/metrics.py``) that show it.
    """

    rules: ClassVar[tuple[str, ...]] = ()
    metrics: ClassVar[tuple[str, ...]] = ()

    def pack(self, ctx: StepContext, packer: Packer) -> Any:
        """Add this rank's values to ``packer``; return the handle ``unpack`` reads (or None:
        nothing packed this step, and ``unpack`` is not called)."""
        return None

    def unpack(
        self, ctx: StepContext, handle: Any, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        """Read the reduced values back into ``report`` (or ``seen``); identical on every rank."""

    def close(self) -> None:
        """Remove hooks and free what the signal holds."""
