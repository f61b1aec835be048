"""The public extension points: your own signals, rules and sinks, passed to ``watch()``.

    agent = torchvitals.watch(
        model, optimizer,
        signals=[ParamNorm(model)],          # a torchvitals.Signal: packs into the step's SUM
        rules=[ParamNormGrowth()],           # a torchvitals.Rule: judges the reduced report
        sinks=[TensorBoardSink(log_dir)],    # a torchvitals.Sink: gets every step's report
    )

(``examples/custom_vitals.py`` is a complete one; ``docs/extending.md`` the guide.)

``Signal``: one vital sign, the same seam the built-in ones use (``signals/registry.py`` lists
those). Each step, ``pack(ctx, packer)`` adds this rank's values to the step's one packed
vector (``packer.add_sum`` / ``add_host_sum`` for sums over the ranks, ``add_max`` for maxima,
``add_local`` for this rank's own value) and returns the ``Slot`` handles; after the one
reduction ``unpack(ctx, handle, reduced, report, seen)`` reads them back (``reduced[slot]``)
into ``report.custom[name]`` (what sinks and the event log see) or ``seen.custom[name]`` (what
only the rules see). A user's signals follow the built-in ones, so they add floats to the same
collectives, never a collective of their own. Every rank must pass the same signals in the
same order (``watch()`` checks it, collectively, and raises on every rank otherwise), and each
must pack the same slots on every rank in a given step: decide from ``ctx.step`` and
``ctx.sampled``, never from this rank's values.

``Rule``: ``observe(report, seen)`` returns the ``Verdict`` list that holds at this report
(empty: healthy), or None when it had nothing to judge (the detector then keeps its active
verdicts); ``patterns`` names the patterns it emits, so the detector clears them when they stop
holding. It runs on every rank over the reduced report, so it must not read ``local_*`` fields
or anything rank-local. A ``CRITICAL`` verdict acts like a built-in one (a rollback, with a
watchdog); a ``WARNING`` is reported once when it becomes active. Rules are deep-copied at each
healthy checkpoint (and restored by a rollback): hold plain numbers. A user pattern shows in
the report, the event log and the sinks; /metrics' per-pattern series keep the built-in set.

``Sink``: ``publish(report)`` once per step on every rank, after the agent's own outputs, and
``close()`` at ``agent.close()``; host values only. One that raises is logged once and counted
(``agent.outputs.failures``); the training goes on.
"""

from __future__ import annotations

from .detect.observed import Observed
from .detect.rules import Rule
from .detect.verdict import CRITICAL, INFO, WARNING, Verdict
from .measure.reduce import Packer, Reduced, Slot
from .outputs.sinks import Sink
from .report import Report
from .signals.base import Signal, StepContext
from .signals.registry import BUILTIN, SignalRegistry

__all__ = [
    "BUILTIN",
    "CRITICAL",
    "INFO",
    "WARNING",
    "Observed",
    "Packer",
    "Reduced",
    "Report",
    "Rule",
    "Signal",
    "SignalRegistry",
    "Sink",
    "Slot",
    "StepContext",
    "Verdict",
]
