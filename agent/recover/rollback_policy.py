"""How far a rollback goes and when rolling back again would not help: back-off, skips, loop guard.

    policy = RollbackPolicy(max_rollbacks=3, rollback_window=500, lr_backoff=0.5, skip_margin=2)
    if (why := policy.refusal(tick, reason)) is not None:
        ...                                          # abort: the loop guard tripped
    rollback = policy.take(tick, to_step=120, from_position=120, position=131, replayable=True)
    rollback.lr_scale, rollback.skipped              # 0.5, (120, 133)

Each rollback multiplies the learning-rate scale by ``lr_backoff`` and, when the loop draws its
batches through the agent (``replayable``), skips those from the checkpoint's position to the
current one plus ``skip_margin``; otherwise the caller re-seeds the RNGs. More than
``max_rollbacks`` rollbacks within ``rollback_window`` ticks (steps taken, rolled-back ones
included) is a loop, not a cure: the caller aborts. Pure arithmetic, the same on every rank.
"""

from __future__ import annotations

from ..report import Rollback


class RollbackPolicy:
    """The back-off, the skipped range and the loop guard of one rank's rollbacks.

    Args:
        max_rollbacks: rollbacks allowed within ``rollback_window``; one more aborts.
        rollback_window: ticks over which they are counted.
        lr_backoff: factor on the learning-rate scale per rollback, in (0, 1].
        skip_margin: batches skipped past the current one.
        lr_scale: the scale left by earlier rollbacks (a resumed run's ledger).
    """

    def __init__(
        self,
        *,
        max_rollbacks: int,
        rollback_window: int,
        lr_backoff: float,
        skip_margin: int,
        lr_scale: float = 1.0,
    ) -> None:
        if max_rollbacks < 0 or rollback_window < 1 or skip_margin < 0:
            raise ValueError("need max_rollbacks >= 0, rollback_window >= 1, skip_margin >= 0")
        if not 0.0 < lr_backoff <= 1.0:
            raise ValueError(f"lr_backoff must be in (0, 1], got {lr_backoff}")
        self.max_rollbacks = max_rollbacks
        self.rollback_window = rollback_window
        self.lr_backoff = lr_backoff
        self.skip_margin = skip_margin
        self.lr_scale = lr_scale
        self.rollbacks = 0
        """Rollbacks taken by this process."""
        self.repeats = 0
        """Of those, the ones that repeated a rollback that did not cure (``repeat_of``)."""
        self._ticks: list[int] = []

    def recent(self, tick: int) -> int:
        """Rollbacks within ``rollback_window`` ticks before ``tick``."""
        return sum(tick - t < self.rollback_window for t in self._ticks)

    def history(self, tick: int) -> list[int]:
        """How many ticks before ``tick`` each rollback the loop guard still counts was taken
        (oldest first): what a restart needs to keep counting them (``remember``)."""
        return [tick - t for t in self._ticks if tick - t < self.rollback_window]

    def remember(self, ago: list[int], tick: int) -> None:
        """Count rollbacks taken ``ago`` ticks before ``tick`` (an earlier process's, from
        ``history``) in the loop guard's window; not in ``rollbacks`` (this process's)."""
        self._ticks = sorted([*(tick - a for a in ago), *self._ticks])

    def refusal(self, tick: int, reason: str) -> str | None:
        """Why another rollback at ``tick`` would be a loop (the abort's reason), or None."""
        recent = self.recent(tick)
        if recent < self.max_rollbacks:
            return None
        return (
            f"{recent + 1} rollbacks within {self.rollback_window} steps "
            f"(max_rollbacks={self.max_rollbacks}); last: {reason}"
        )

    def margin(self, escalation: int = 0) -> int:
        """Batches skipped past the current one: ``skip_margin``, doubled per repeat in a row."""
        return self.skip_margin * 2**escalation

    def take(
        self,
        tick: int,
        *,
        to_step: int,
        from_position: int,
        position: int,
        replayable: bool,
        escalation: int = 0,
        repeat_of: int | None = None,
    ) -> Rollback:
        """Count a rollback at ``tick`` and back the learning rate off.

        Args:
            tick: the agent's step counter that rollbacks do not rewind.
            to_step: the healthy step restored.
            from_position: the batch position saved with that step.
            position: the batch position now (the next batch to draw).
            replayable: the batches come through the agent, so they can be skipped.
            escalation: rollbacks in a row that did not cure before this one (``targets``):
                the learning rate is cut ``escalation`` more times and the margin doubled as
                often.
            repeat_of: the step of the rollback this one repeats (None: a first rollback).

        Returns:
            The Rollback.
        """
        self.lr_scale *= self.lr_backoff ** (1 + escalation)
        margin = self.margin(escalation)
        skipped = (from_position, position + margin) if replayable else None
        self.rollbacks += 1
        self.repeats += repeat_of is not None
        # Ticks never go back, so one outside the window now stays outside: only the window's
        # are kept (at most max_rollbacks + 1, however long the run).
        self._ticks = [t for t in self._ticks if tick - t < self.rollback_window] + [tick]
        return Rollback(
            to_step=to_step,
            lr_scale=self.lr_scale,
            skipped=skipped,
            escalation=escalation,
            repeat_of=repeat_of,
        )
