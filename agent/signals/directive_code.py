"""Collector directives: an order (rollback, abort) polled by global rank 0, obeyed by all.

Only rank 0 polls (off the training thread); its directive code rides the SUM, every other
rank adds 0, so every rank reads the same code in the same step.
"""

from __future__ import annotations

from ..detect.observed import Observed
from ..measure.reduce import Packer, Reduced, Slot
from ..recover.directives import DirectivePoller
from ..report import Report
from .base import Signal, StepContext
from .setup import Setup


class DirectiveSignal(Signal):
    rules = ("collector_directive",)
    fills = ("seen.directive",)

    def __init__(self, poller: DirectivePoller | None) -> None:
        self.poller = poller
        """This rank's poller (global rank 0), or None."""

    def pack(self, ctx: StepContext, packer: Packer) -> Slot:
        return packer.add_host_sum([self.poller.code() if self.poller is not None else 0.0])

    def unpack(
        self, ctx: StepContext, handle: Slot, reduced: Reduced, report: Report, seen: Observed
    ) -> None:
        seen.directive = reduced.scalar(handle)


def build(setup: Setup) -> DirectiveSignal | None:
    """With a collector only; every rank packs the slot, only global rank 0 has a poller."""
    return DirectiveSignal(setup.poller) if setup.config.collector_url else None
