"""When a step is healthy, and when a healthy checkpoint is due.

    policy = SavePolicy(checkpoint_every=50, healthy_window=20)
    policy.note(step, report.verdicts)              # every step, every rank
    policy.due(step, active)                        # active: the verdicts still holding

A step is *healthy* when no warning or critical verdict about the model came in the
``healthy_window`` steps before it and none is still active: a hot learning rate that keeps
holding makes no step healthy. Process warnings (straggler, memory growth, data stall) do not
count: they say nothing of the weights. Every ``checkpoint_every`` steps a healthy step is saved.
Pure bookkeeping over verdicts: every rank sees the same ones, so every rank answers alike.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..detect.verdict import CRITICAL, PROCESS_PATTERNS, WARNING, Verdict

NEVER = -(10**9)
"""``last_bad`` before any bad verdict: far enough back for any window."""


def unhealthy(verdict: Verdict) -> bool:
    """Whether ``verdict`` says something is wrong with the model (not with the process)."""
    return verdict.severity in (WARNING, CRITICAL) and verdict.pattern not in PROCESS_PATTERNS


class SavePolicy:
    """Whether a step is healthy and a checkpoint due; remembers the last unhealthy step.

    Args:
        checkpoint_every: a healthy checkpoint every this many steps.
        healthy_window: steps after an unhealthy verdict before a step is healthy again.
    """

    def __init__(self, *, checkpoint_every: int, healthy_window: int) -> None:
        if checkpoint_every < 1 or healthy_window < 0:
            raise ValueError(
                "need checkpoint_every >= 1 and healthy_window >= 0, got "
                f"{checkpoint_every} and {healthy_window}"
            )
        self.checkpoint_every = checkpoint_every
        self.healthy_window = healthy_window
        self.last_bad = NEVER
        """The last step with an unhealthy verdict (or the step a rollback went back to)."""

    def note(self, step: int, verdicts: Iterable[Verdict]) -> None:
        """Take in the verdicts of ``step``."""
        if any(unhealthy(v) for v in verdicts):
            self.last_bad = step

    def restart_at(self, step: int) -> None:
        """A rollback went back to ``step``: the window starts over from there."""
        self.last_bad = step

    def healthy(self, step: int, active: Iterable[Verdict]) -> bool:
        """No unhealthy verdict within ``healthy_window`` steps and none in ``active``.

        Args:
            step: the step judged.
            active: the verdicts still holding at ``step`` (wiring facts left out by the caller:
                a block frozen on purpose holds for the whole run).
        """
        if step - self.last_bad <= self.healthy_window:
            return False
        return not any(unhealthy(v) for v in active)

    def due(self, step: int, active: Iterable[Verdict]) -> bool:
        """Whether ``step`` is saved: a multiple of ``checkpoint_every`` and healthy."""
        return step % self.checkpoint_every == 0 and self.healthy(step, active)
