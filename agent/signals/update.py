"""The update ratio ||dw|| / ||w|| per block, on sampled steps.

The parameters are snapshotted just before the real optimizer step of the step before a sampled
one and compared just after it; the two per-block sums ride the next (sampled) step's SUM, so
the report of step s carries the ratio of the update applied at step s - 1
(``update_ratio_step``). A rollback forgets a pending measurement: it described weights that
are gone.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..detect.observed import Observed
from ..measure.reduce import Packer, Reduced, Slot
from ..measure.stats import UpdateRatio
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup


@dataclasses.dataclass(frozen=True)
class PendingUpdate:
    """One measured update, waiting for the next reduction."""

    d_sq: torch.Tensor
    w_sq: torch.Tensor
    chosen: list[bool]
    step: int


@dataclasses.dataclass(frozen=True)
class UpdateSlots:
    pending: PendingUpdate
    d_sq: Slot
    w_sq: Slot


class UpdateRatioSignal(Signal):
    rules = ("UpdateRatios",)
    fills = ("update_ratio", "update_ratio_step")
    metrics = ("torchvitals_update_ratio",)

    def __init__(self, stats: UpdateRatio, names: list[str]) -> None:
        self.stats, self.names = stats, names
        self._pending: PendingUpdate | None = None

    def before_step(self) -> None:
        """Just before the real optimizer step: snapshot the selected blocks."""
        self.stats.before_step()

    def after_step(self, step: int, device: torch.device) -> None:
        """Just after it: the update's per-block sums, for the next step's reduction."""
        measured = self.stats.after_step(device)
        if measured is not None:
            self._pending = PendingUpdate(*measured, step)

    def forget(self) -> None:
        """A rollback: the pending update described weights that were replaced."""
        self._pending = None

    def pack(self, ctx: StepContext, packer: Packer) -> UpdateSlots | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return UpdateSlots(pending, packer.add_sum(pending.d_sq), packer.add_sum(pending.w_sq))

    def unpack(
        self,
        ctx: StepContext,
        handle: UpdateSlots | None,
        reduced: Reduced,
        report: Report,
        seen: Observed,
    ) -> None:
        if handle is None:
            return
        d_sq, w_sq = reduced[handle.d_sq], reduced[handle.w_sq]
        report.update_ratio = {
            n: _ratio(d, w)
            for n, d, w, c in zip(self.names, d_sq, w_sq, handle.pending.chosen)
            if c
        }
        report.update_ratio_step = handle.pending.step


def build(setup: Setup) -> UpdateRatioSignal | None:
    """On unless ``Config.update_ratio`` is off."""
    if not setup.config.update_ratio:
        return None
    stats = UpdateRatio(
        setup.blocks,
        setup.owned(),
        setup.world_size,
        setup.split,
        setup.config.update_ratio_max_bytes,
        setup.param_source,
    )
    return UpdateRatioSignal(stats, setup.blocks.names)


def _ratio(d_sq: float, w_sq: float) -> float:
    if w_sq == 0:
        return 0.0 if d_sq == 0 else math.inf
    return math.sqrt(d_sq) / math.sqrt(w_sq)
