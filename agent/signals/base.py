"""What a vital sign is to the step: a vertical slice that packs, reads back and is judged.

    class Memory(Signal):
        def pack(self, ctx, packer):             # measure: this rank's values, typed slots
            return packer.add_max(...) if ctx.sampled else None
        def unpack(self, ctx, handle, reduced, report, seen):   # after the one reduction
            if handle is not None:
                report.memory = ...

Each signal of ``agent/signals/`` is one module: the local measurement it packs into the
step's one SUM vector (and, on sampled steps, the MAX vector), how it reads its slots back into
the Report (or, for what is not a report field, into ``Observed``, the rules' other input), the
names of the rules that judge it, of the metric families that show it and of the fields it
fills (the rules live in ``detect/``, the metric table in ``outputs/metrics.py``: each name is
defined once there), and its ``build(setup)`` factory, listed in order in ``registry.py``. The
step (``agent/step.py``) calls every signal in the same order on every rank, so the packed
layout, and with it the collectives, always match. A user's own signals (``watch(signals=)``,
``torchvitals.Signal``) follow the built-in ones and keep the same contract.
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
    loop_skipped: bool = False
    """The loop (or a framework) skipped this step's ``optimizer.step()`` on this rank by itself
    and cleared the gradients (``Agent._settle_skipped``)."""
    repeated: bool = False
    """No backward pass reached the model on this rank since its last step: the same gradients
    would be applied twice."""


class Signal:
    """One vital sign. Subclasses implement ``pack`` and ``unpack``; the default packs nothing.

    Every rank must run the same signals in the same order, and each must pack the same slots
    (same kinds, same lengths) on every rank in a given step: decide from what is identical on
    every rank (``ctx.step``, ``ctx.sampled``), never from this rank's values. The SUM and MAX
    vectors are summed slot by slot, so a rank that packs otherwise breaks the collective.

    Attributes:
        rules: the names of the ``detect`` rules that judge what this signal fills in.
        metrics: the metric families (``outputs/metrics.py``) that show it.
        fills: the Report fields it writes (``seen.<name>``: a field of ``Observed``;
            ``custom.<key>``: a key of ``Report.custom``).
    """

    rules: ClassVar[tuple[str, ...]] = ()
    metrics: ClassVar[tuple[str, ...]] = ()
    fills: ClassVar[tuple[str, ...]] = ()

    def pack(self, ctx: StepContext, packer: Packer) -> Any:
        """Add this rank's values to ``packer``; return the handle ``unpack`` reads (None:
        nothing packed this step)."""
        return None

    def unpack(
        self, ctx: StepContext, handle: Any, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        """Read the reduced values back into ``report`` (or ``seen``); identical on every rank.
        Called every step, after every signal packed, with what ``pack`` returned (None when
        it packed nothing: a signal may still fill what it keeps from an earlier step)."""

    def close(self) -> None:
        """Remove hooks and free what the signal holds (at ``agent.close()``)."""
