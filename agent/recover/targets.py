"""Which healthy checkpoints a rollback may go back to, and whether the last rollback cured.

    targets = Targets(trust_steps=5, verify_steps=20)
    targets.saved(60)                        # a healthy checkpoint of step 60 was staged
    targets.committed(60)                    # ... and every rank's write succeeded
    targets.take_trusted()                   # [(50, 52)]: trust earned since asked (ledger)
    distrusted = targets.note(61, "loss_outlier")   # every step: the first unhealthy pattern
    target = targets.target()                # the newest trusted one: 50 here, not 60
    targets.rolled_back(at=62, to_step=50)
    repeat = targets.repeat(70)              # another rollback at 70: a Repeat of the one at 62

Every method that distrusts returns ``{step: why}`` of the committed checkpoints it distrusted,
for the ledger (``Ledger.record_distrust``), which a restart reads back.

A checkpoint is saved at a healthy step, but the update that causes a spike is taken a step or
more before the loss shows it: the checkpoint of the step that took a learning rate too hot
holds the damage already. So a checkpoint is *trusted* only once ``trust_steps`` steps after it
passed without an unhealthy verdict; one that came sooner *distrusts* it (*tainted*): it is a
rollback target only as a last resort, when no trusted one is left, and never a restart's
(through the ledger). A rollback goes to the newest trusted checkpoint; one that did not cure
the run (another rollback within ``verify_steps`` steps of the step that caused it) distrusts
its target for good, and the next rollback is a *repeat*: it goes to an earlier checkpoint,
with a deeper learning-rate cut and a wider skip (``escalation``).
A rollback also abandons every checkpoint newer than its target: they hold a run that no longer
happened. Pure bookkeeping over the steps and verdicts every rank shares, so every rank answers
alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Repeat:
    """A rollback that did not cure: the next one escalates."""

    of: int
    """The step whose verdict caused the rollback that did not cure."""
    to_step: int
    """The checkpoint it went back to (now distrusted)."""
    escalation: int
    """How many rollbacks in a row have failed, this one's predecessor included (1, 2, ...)."""


@dataclass
class _Verifying:
    at: int
    """The step whose verdict caused the rollback."""
    to_step: int
    """The checkpoint restored."""


class Targets:
    """This rank's view (every rank's) of the rollback targets.

    Args:
        trust_steps: clean steps after a checkpoint before it is a rollback target.
        verify_steps: steps past the step that caused a rollback that the run must get through
            without another rollback for it to count as cured.
        committed: checkpoints already committed (a resumed run's ledger).
        trusted: those of ``committed`` that earned trust (the ledger's ``trust`` records); the
            others are watched again from the steps a resumed run takes after them. None:
            every committed one is trusted.
        distrusted: ``{step: why}`` already distrusted (the ledger's).
        keep: how many checkpoints the store keeps (``checkpoint_keep``): older ones are pruned
            from disk and forgotten here as they are, so nothing grows with the run; None:
            every one is remembered.
    """

    def __init__(
        self,
        *,
        trust_steps: int,
        verify_steps: int,
        committed: Iterable[int] = (),
        trusted: Iterable[int] | None = None,
        distrusted: dict[int, str] | None = None,
        keep: int | None = None,
    ) -> None:
        if trust_steps < 1 or verify_steps < 1:
            raise ValueError(
                f"need trust_steps >= 1 and verify_steps >= 1, got {trust_steps} and {verify_steps}"
            )
        self.trust_steps = trust_steps
        self.verify_steps = verify_steps
        self.keep = keep
        self.distrusted: dict[int, str] = dict(distrusted or {})
        """``{step: why}``: never a rollback target."""
        self._committed: set[int] = set(committed) - set(self.distrusted)
        self._trusted: set[int] = set(self._committed if trusted is None else trusted)
        self._trusted &= self._committed
        self._watching: dict[int, int] = {s: 0 for s in self._committed - self._trusted}
        """Saved steps not yet trusted: how many clean steps have followed each."""
        self._trusted_at: dict[int, int] = {}
        """Step -> the last of the clean steps after it that earned its trust."""
        self._told: set[int] = set(self._trusted)
        """Trusted, committed checkpoints ``take_trusted`` already returned (or the ledger
        already holds)."""
        self._tainted: set[int] = set()
        """Distrusted only because trouble followed them within ``trust_steps`` (no rollback
        to them failed): a last resort when no trusted checkpoint is left."""
        self._verifying: _Verifying | None = None
        self.escalation = 0
        """Rollbacks in a row that did not cure (0: the last one did, or none yet)."""
        self.cured: int | None = None
        """The step at which the last rollback was found to have cured the run (None: not
        yet); the caller may take it (the learning rate's ramp back starts there)."""
        self._prune()

    def saved(self, step: int) -> None:
        """A healthy checkpoint of ``step`` was started (its commit may come steps later)."""
        self._committed.discard(step)  # a step saved again after a rollback starts over
        self._trusted.discard(step)
        self._told.discard(step)
        self._trusted_at.pop(step, None)
        self._tainted.discard(step)
        self.distrusted.pop(step, None)
        self._watching[step] = 0

    def committed(self, step: int) -> dict[int, str]:
        """Every rank's write of ``step`` succeeded; returns ``{step: why}`` when it was
        distrusted before its commit (the ledger records that after the checkpoint)."""
        if step not in self.distrusted or step in self._tainted:  # tainted: a last resort
            self._committed.add(step)
            self._prune()
        return {step: self.distrusted[step]} if step in self.distrusted else {}

    def take_trusted(self) -> list[tuple[int, int]]:
        """``(step, clean through)`` of the committed checkpoints that earned trust since the
        last call, oldest first (for the ledger's ``trust`` records): the last of the clean
        steps that earned it."""
        new = sorted((self._committed & self._trusted) - self._told)
        self._told.update(new)
        return [(s, self._trusted_at.pop(s, s + self.trust_steps)) for s in new]

    def failed(self, step: int) -> None:
        """The write of ``step`` failed: never a target."""
        self._watching.pop(step, None)
        self._trusted.discard(step)

    def note(self, step: int, unhealthy: str | None) -> dict[int, str]:
        """Take in ``step``: ``unhealthy`` names its first verdict about the model, if any.

        Returns:
            The committed checkpoints this step distrusted, ``{step: why}`` (for the ledger;
            one not committed yet is returned by ``committed``).
        """
        newly: dict[int, str] = {}
        for saved, clean in list(self._watching.items()):
            if step <= saved:
                continue  # a step replayed before it, after a rollback: judged once run again
            if unhealthy is not None:
                del self._watching[saved]
                newly[saved] = (
                    f"{unhealthy} at step {step}, {step - saved} step(s) after it: the update "
                    f"that caused it may be in it"
                )
            elif clean + 1 >= self.trust_steps:
                del self._watching[saved]
                self._trusted.add(saved)
                self._trusted_at[saved] = step
            else:
                self._watching[saved] = clean + 1
        if self._verifying is not None and step >= self._verifying.at + self.verify_steps:
            self._verifying, self.escalation = None, 0  # the run got past it: cured
            self.cured = step
        recorded = {s: why for s, why in newly.items() if s in self._committed}
        self.distrusted.update(newly)
        self._tainted.update(newly)
        self._trusted.difference_update(newly)
        return recorded

    def target(self) -> int | None:
        """The newest committed, trusted checkpoint; else, as a last resort, the newest one
        distrusted only because trouble followed it soon (``last_resort``); else None."""
        newest = max(self._committed & self._trusted, default=None)  # never a distrusted one
        return newest if newest is not None else self.last_resort()

    def last_resort(self) -> int | None:
        """The newest committed checkpoint that trouble followed within ``trust_steps`` and no
        failed rollback distrusted (None: none)."""
        return max(self._committed & self._tainted, default=None)

    def candidates(self) -> set[int]:
        """Every checkpoint that may still become a target (committed or trusted later)."""
        return (self._committed | self._trusted | set(self._watching)) - (
            set(self.distrusted) - self._tainted
        )

    def repeat(self, step: int) -> Repeat | None:
        """Whether a rollback decided at ``step`` repeats one that did not cure (then its
        target is distrusted: ``fail_verification``); None: a first rollback."""
        v = self._verifying
        if v is None or step >= v.at + self.verify_steps:
            return None
        return Repeat(of=v.at, to_step=v.to_step, escalation=self.escalation + 1)

    def fail_verification(self, repeat: Repeat, step: int, reason: str) -> dict[int, str]:
        """The rollback ``repeat`` names did not cure (``reason`` at ``step``): its target is
        distrusted; returns ``{step: why}`` for the ledger."""
        self.escalation = repeat.escalation
        why = (
            f"the rollback to it at step {repeat.of} did not cure the run: {reason} again at "
            f"step {step}"
        )
        return self._distrust({repeat.to_step: why})

    def rolled_back(self, at: int, to_step: int) -> dict[int, str]:
        """Every rank went back from ``at`` to ``to_step``: the newer checkpoints are abandoned
        and the rollback is verified from now on; returns what it distrusted, for the ledger."""
        newly = {
            s: f"newer than step {to_step}, which the rollback at step {at} went back to"
            for s in (self._committed | set(self._watching))
            if s > to_step and (s not in self.distrusted or s in self._tainted)
        }
        for s in newly:
            self._watching.pop(s, None)
        self._verifying = _Verifying(at, to_step)
        return self._distrust(newly)

    def forget(self, step: int) -> None:
        """The checkpoint of ``step`` is gone (pruned): never a target."""
        self._watching.pop(step, None)
        self._committed.discard(step)
        self._trusted.discard(step)
        self._tainted.discard(step)
        self._told.discard(step)
        self._trusted_at.pop(step, None)

    def distrust(self, step: int, why: str) -> dict[int, str]:
        """Never go back to ``step`` (it failed to load); returns it if committed, as above."""
        self._watching.pop(step, None)
        return self._distrust({step: why})

    def _prune(self) -> None:
        """Forget what the store prunes after a commit (``CheckpointStore._prune``): every
        checkpoint older than the oldest of the newest ``keep`` not distrusted."""
        counted = sorted(self._committed - self._tainted)
        if self.keep is None or len(counted) <= self.keep:
            return
        oldest_kept = counted[-self.keep]
        for s in [s for s in self._committed if s < oldest_kept]:
            self.forget(s)

    def _distrust(self, newly: dict[int, str]) -> dict[int, str]:
        """Distrust ``newly``; returns those already committed (the ledger's to record)."""
        recorded = {s: why for s, why in newly.items() if s in self._committed}
        for s, why in newly.items():
            self.distrusted[s] = why
            self._committed.discard(s)
            self._trusted.discard(s)
            self._tainted.discard(s)
            self._told.discard(s)
            self._trusted_at.pop(s, None)
        return recorded
