"""Whether an ended attempt is restarted, and when restarting again would not help.

    policy = RestartPolicy.from_config(config)
    decision = policy.settle(outcome, job)      # the ending decides by itself, or None
    if decision is None:                        # a crash or a hang: a restart, if the limits allow
        decision = policy.after_failure(outcome, job, progress=last_healthy_step)
    decision                                    # Succeed, Obey, NoRestart, GiveUp, Restart, Follow

An attempt that exited 0 ends the job; one whose ranks refused their checkpoint folder or
aborted on purpose (their last heartbeat says so) is never restarted: a restart meets the same
folder, or undoes a person's or the loop guard's decision. An order from another node is
obeyed: the job's end, a restart elsewhere (followed), a lost node (a restart at once, counted).
A crash or a hang is restarted after a back-off of ``backoff_s`` doubled per restart in a row
without progress (at most ``backoff_max_s``; progress resets it), until ``max_restarts``
restarts are spent or ``no_progress_restarts`` in a row did not move the last healthy step.
The restart counts live in the job's record (``JobAttempt``), the same on every node; the
policy is pure arithmetic on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol import (
    ABORT_EXIT_CODE,
    BUDGET_EXIT_CODE,
    NO_PROGRESS_EXIT_CODE,
    REFUSED_EXIT_CODE,
)
from .options import SupervisorConfig
from .orders import JobEnded, JobRestarted, NodesLost
from .outcomes import Exited, Hung, Ordered, Outcome
from .store_schema import JobAttempt


@dataclass(frozen=True)
class Succeed:
    """The job finished: exit 0."""


@dataclass(frozen=True)
class Obey:
    """The job ended for good on another node's word: exit with its ``code``."""

    code: int


@dataclass(frozen=True)
class NoRestart:
    """Never restart (a refused folder, an abort on purpose): end the job with ``code``."""

    code: int
    why: str


@dataclass(frozen=True)
class GiveUp:
    """The restart limits are spent: end the job with ``code``."""

    code: int
    why: str


@dataclass(frozen=True)
class Restart:
    """Make ``record`` the job's next attempt (every node follows)."""

    record: JobAttempt
    label: str
    """The restart counter's ``reason`` label: "crash", "hang" or "lost"."""
    backoff_s: float | None
    """Seconds to wait after the restart was agreed (None: start at once)."""


@dataclass(frozen=True)
class Follow:
    """The job moved on elsewhere: follow its record, restarting nothing here."""

    label: str | None = None
    """The restart counter's label to count the restart under ("peer"), or None: not counted
    (this node saw it only after its own attempt had ended)."""


Decision = Succeed | Obey | NoRestart | GiveUp | Restart | Follow


def failure(outcome: Outcome) -> str:
    """A failed attempt's kind, as logs and the restart counter name it: "hang" or "crash"."""
    return "hang" if isinstance(outcome, Hung) else "crash"


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """The restart limits, the back-off and the exit codes of the end of a job."""

    max_restarts: int = 10
    """Restarts allowed in all (any node's)."""
    no_progress_restarts: int = 3
    """Consecutive restarts without advancing the last healthy step that end the job."""
    backoff_s: float = 1.0
    """Wait before a restart; doubled for each consecutive restart without progress."""
    backoff_max_s: float = 60.0
    """Cap of the back-off."""
    abort_exit_code: int = ABORT_EXIT_CODE
    """The job aborted on purpose."""
    no_progress_exit_code: int = NO_PROGRESS_EXIT_CODE
    """``no_progress_restarts`` restarts in a row made no progress."""
    budget_exit_code: int = BUDGET_EXIT_CODE
    """``max_restarts`` restarts are spent."""
    refused_exit_code: int = REFUSED_EXIT_CODE
    """The job refused its checkpoint folder."""
    node: int = 0
    """This node's rank (named in the reason of a restart it makes)."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.no_progress_restarts < 1:
            raise ValueError("need max_restarts >= 0 and no_progress_restarts >= 1")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("need 0 <= backoff_s <= backoff_max_s")

    @classmethod
    def from_config(cls, config: SupervisorConfig) -> RestartPolicy:
        """The policy ``config`` sets out (its node rank already resolved)."""
        return cls(
            max_restarts=config.max_restarts,
            no_progress_restarts=config.no_progress_restarts,
            backoff_s=config.backoff_s,
            backoff_max_s=config.backoff_max_s,
            abort_exit_code=config.abort_exit_code,
            no_progress_exit_code=config.no_progress_exit_code,
            budget_exit_code=config.budget_exit_code,
            refused_exit_code=config.refused_exit_code,
            node=config.node_rank or 0,
        )

    def settle(self, outcome: Outcome, job: JobAttempt) -> Decision | None:
        """What the ending decides by itself, or None for a failure the limits decide.

        Args:
            outcome: how the attempt ended.
            job: the job's record when the attempt started.
        """
        if isinstance(outcome, Ordered):
            return self._obey(outcome, outcome.order, job)
        if isinstance(outcome, Exited) and outcome.status == 0:
            return Succeed()
        beat = outcome.beat
        if beat is not None and beat.refused:
            return NoRestart(
                self.refused_exit_code,
                f"the job refused to resume its checkpoint folder (attempt {outcome.number}, "
                f"status {outcome.status}); see the job's log for both job ids and the fix",
            )
        if beat is not None and beat.aborted:
            return NoRestart(
                self.abort_exit_code,
                f"the job aborted itself (attempt {outcome.number}, status {outcome.status}, "
                f"step {beat.step})",
            )
        return None

    def after_failure(
        self, outcome: Outcome, job: JobAttempt, progress: int | None
    ) -> Restart | GiveUp:
        """A crash or a hang: restart, or give up when the limits are spent.

        Args:
            outcome: how the attempt ended.
            job: the job's record now (still at this attempt).
            progress: the last healthy step after the attempt (None: unknown).
        """
        best, stalled = job.best, job.stalled
        if progress is not None and (best is None or progress > best):
            best, stalled = progress, 0
        elif outcome.number > 1:
            stalled += 1  # a restart that did not move the last healthy step
        if stalled >= self.no_progress_restarts:
            return GiveUp(
                self.no_progress_exit_code,
                f"{stalled} restarts in a row without progress past step {best}",
            )
        if job.restarts >= self.max_restarts:
            return GiveUp(self.budget_exit_code, f"restart budget ({self.max_restarts}) spent")
        kind = failure(outcome)
        return Restart(
            JobAttempt(
                number=outcome.number + 1,
                restarts=job.restarts + 1,
                best=best,
                stalled=stalled,
                reason=f"node {self.node}: attempt {outcome.number} ended by {kind}",
            ),
            label=kind,
            # Progress resets the back-off: a job that fails rarely restarts quickly.
            backoff_s=min(self.backoff_max_s, self.backoff_s * 2**stalled),
        )

    def _obey(
        self, outcome: Ordered, order: JobRestarted | NodesLost | JobEnded, job: JobAttempt
    ) -> Decision:
        if isinstance(order, JobEnded):
            return Obey(order.code)
        if isinstance(order, NodesLost):
            # The nodes start again at once, a replacement or ``min_nodes`` permitting.
            return Restart(
                JobAttempt(
                    number=outcome.number + 1,
                    restarts=job.restarts + 1,
                    best=job.best,
                    stalled=job.stalled,
                    reason=order.reason,
                ),
                label="lost",
                backoff_s=None,
            )
        return Follow("peer")
