"""Detection: turn the stream of step reports into named verdicts.

The Detector runs on every rank from the reduced report only (never from ``local_*`` fields),
with the same deterministic code, so every rank reaches the same verdicts in the same step.
A warning is emitted when its (pattern, block) becomes active and stays active, silently, while
its rule keeps seeing it; critical verdicts are emitted every step they hold, since the
watchdog acts on each.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from ..report import Report
from .history import VerdictHistory, identity
from .observed import Observed
from .rules import LossSpike, Rule, make_rules
from .rules_vitals import make_vital_rules
from .straggler import Straggler
from .thresholds import Thresholds
from .verdict import CRITICAL, Verdict


class Detector:
    """Runs the pattern rules over each report; keeps the active set and a bounded history
    (``history.VerdictHistory``: each finding's first verdict and the newest 1000).

    Args:
        block_names, block_kinds: the blocks every rank packs.
        thresholds: the numbers the built-in rules compare against.
        static: wiring verdicts found before the first step, active for the whole run.
        rules: the user's own rules (``watch(rules=[...])``), run after the built-in ones. Each
            must be deterministic in the reduced report (every rank must reach the same
            verdicts) and copyable (``snapshot`` deep-copies the rules at each checkpoint).
    """

    def __init__(
        self,
        block_names: list[str],
        block_kinds: list[str],
        thresholds: Thresholds | None = None,
        static: list[Verdict] | None = None,
        rules: Sequence[Rule] = (),
    ):
        for rule in rules:
            if not isinstance(rule, Rule):
                raise TypeError(
                    f"watch(rules=...) takes torchvitals.Rule instances, not {type(rule).__name__}"
                )
        self.thresholds = thresholds or Thresholds()
        self.block_names, self.block_kinds = block_names, block_kinds
        self.rules: list[Rule] = [
            *make_rules(block_names, block_kinds, self.thresholds),
            Straggler(self.thresholds),
            *make_vital_rules(self.thresholds),
            *rules,
        ]
        self._static = list(static or [])
        # Keyed by (pattern, block, rank): a straggler has no block but one verdict per rank.
        self.active: dict[tuple[str, str | None, Any], Verdict] = {}
        self.pinned: set[tuple[str, str | None, Any]] = set()
        """Keys of the wiring facts (a frozen block): active for the whole run."""
        self.history = VerdictHistory()
        """The verdicts emitted so far, oldest first, bounded (see ``history``)."""
        self._validation: list[tuple[int, float]] = []

    def observe(self, report: Report, seen: Observed | None = None) -> list[Verdict]:
        """Judge one report; return the verdicts new at this step (and every critical one).

        Args:
            report: the reduced, rank-identical step report.
            seen: the step's other rank-identical inputs (straggler flags); the validation
                losses queued by ``observe_validation`` are added to it.
        """
        seen = seen if seen is not None else Observed()
        if self._validation:
            seen.validation = seen.validation + self._validation
            self._validation = []
        emitted: list[Verdict] = []
        if self._static:
            # Wiring facts (a frozen block) hold for the whole run: no rule may clear them.
            emitted += [dataclasses.replace(v, step=report.step) for v in self._static]
            for v in emitted:
                self.active[identity(v)] = v
                self.pinned.add(identity(v))
            self._static = []
        for rule in self.rules:
            found = rule.observe(report, seen)
            if found is None:  # the rule had nothing to judge this step
                continue
            keys = {identity(v) for v in found}
            for key in [
                k
                for k in self.active
                if k[0] in rule.patterns and k not in keys and k not in self.pinned
            ]:
                del self.active[key]
            for v in found:
                key = identity(v)
                if v.severity == CRITICAL or key not in self.active:
                    emitted.append(v)
                self.active[key] = v
        self.history.extend(emitted)
        return emitted

    def snapshot(self) -> Any:
        """The rules' windows as they are now (a few hundred floats), for ``restore``."""
        return copy.deepcopy(self.rules)

    def restore(self, rules: Any) -> None:
        """Go back to a ``snapshot`` (the detector as it was at a checkpoint); keep the history,
        so a failure that returns after a rollback is judged against the same healthy baseline."""
        self.rules = copy.deepcopy(rules)

    def observe_validation(self, step: int, loss: float) -> None:
        """Queue a validation loss (already identical on every rank) for the next report."""
        self._validation.append((step, float(loss)))

    def loss_level(self) -> tuple[float, float] | None:
        """(median, threshold) of the loss at the last judged step, identical on every rank;
        None before the loss rule had history enough to judge (``LossSpike.level``)."""
        for rule in self.rules:
            if isinstance(rule, LossSpike):
                return rule.level
        return None

    def transient(self) -> None:
        """The last step's loss outlier did not reproduce when computed again (a transient
        fault): it does not count toward a spike (two steps past the threshold of three)."""
        for rule in self.rules:
            if isinstance(rule, LossSpike) and rule.above:
                rule.above[-1] = False

    def is_active(self, pattern: str, block: str | None = None) -> bool:
        """Whether ``pattern`` is active now (in ``block``, when given)."""
        return any(k[0] == pattern and (block is None or k[1] == block) for k in self.active)

    def active_counts(self) -> dict[str, int]:
        """pattern -> number of (pattern, block) pairs active now."""
        counts: dict[str, int] = {}
        for pattern, _, _ in self.active:
            counts[pattern] = counts.get(pattern, 0) + 1
        return counts
