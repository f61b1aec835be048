"""Collector directives: an order (rollback, abort) polled by global rank 0, obeyed by all.

Only rank 0 polls (off the training thread); its directive code rides the SUM, every other
rank adds 0, so every rank reads the same code in the same step.
"""

from __future__ import annotations

from typing import Any

from ..detect.observed import Observed
from ..measure.reduce import Packer, Reduced, Slot
from ..report import Report
from .base import Signal, StepContext


class Directives(Signal):
    rules = ("collector_directive",)

    def __init__(self, poller: Any) -> None:
        self.poller = poller
        """This rank's poller (global rank 0), or None."""

    def pack(self, ctx: StepContext, packer: Packer) -> Slot:
        return packer.add_host_sum([self.poller.code() if self.poller is not None else 0.0])

    def unpack(
        self, ctx: StepContext, handle: Slot, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        seen.directive = reduced.scalar(handle)
