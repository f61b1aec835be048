"""Whether a running attempt hangs, told from its ranks' heartbeats alone.

    clock = HangClock(config, intervals, now=time.monotonic(), first_start_s=learned)
    clock.observe(read_heartbeats(folder), now)      # each poll
    clock.between_workers(no_rank_runs, now)         # torchrun restarting its workers
    clock.hung(now), clock.age(now), clock.timeout(), clock.phase()

Four phases, each with its own bound:

- ``startup``: the job's first start (attempt start to first heartbeat): ``startup_timeout_s``
  (imports, rendezvous, a first compile: nothing is known yet).
- ``restart``: a re-start, of a new attempt or of torchrun's workers within one (from the moment
  no rank of the last heartbeat runs): a start the job has done before, so its bound is learned,
  ``restart_factor`` x the first start's duration, at least ``restart_floor_s``. A restart
  stuck in its rendezvous is named within that, not after the cold-start timeout.
- ``checkpoint``: any rank writes or loads a checkpoint: ``checkpoint_timeout_s``.
- ``train``: ``hang_timeout_s``, or learned from the observed intervals between advances:
  ``hang_factor`` x their median, at least ``hang_floor_s``.
"""

from __future__ import annotations

import statistics
from collections import deque

from ..protocol import Beat
from .options import SupervisorConfig

STARTUP, RESTART, CHECKPOINT, TRAIN = "startup", "restart", "checkpoint", "train"


class HangClock:
    """Decides whether an attempt hangs, from the beats it is shown over time.

    Args:
        config: the timeouts.
        intervals: observed seconds between advances, shared across attempts so a restarted
            job keeps the learned timeout.
        now: the attempt's start (monotonic seconds).
        first_start_s: the job's first start (its first attempt's start to first heartbeat),
            learned by an earlier attempt; None: this attempt's start is the first.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        intervals: deque[float],
        now: float,
        *,
        first_start_s: float | None = None,
    ) -> None:
        self.config, self.intervals = config, intervals
        self.started = self.advanced = now
        self.beat: Beat | None = None
        self.first_start_s = first_start_s
        """The job's first start, in seconds (measured at this attempt's first heartbeat when no
        earlier attempt had)."""
        self.restarting_since: float | None = None
        """When no rank of the last beat was seen running while the launcher runs: torchrun is
        restarting its workers (an elastic restart, a rendezvous for peers)."""

    def observe(self, beat: Beat | None, now: float) -> None:
        if beat is None or beat == self.beat:
            return
        if self.beat is None and self.first_start_s is None:
            self.first_start_s = now - self.started
        if self.beat is not None and beat.step > self.beat.step:
            self.intervals.append(now - self.advanced)
        self.beat, self.advanced = beat, now

    def between_workers(self, between: bool, now: float) -> None:
        """Whether torchrun is between two groups of workers (no rank of the last beat runs)."""
        if not between:
            self.restarting_since = None
        elif self.restarting_since is None:
            self.restarting_since = now

    def phase(self) -> str:
        if self.beat is None or self.restarting_since is not None:
            return STARTUP if self.first_start_s is None else RESTART
        return CHECKPOINT if self.beat.checkpointing else TRAIN

    def age(self, now: float) -> float:
        """Seconds the phase has waited: since the last advance, since the attempt's start
        before the first beat, since the workers were seen gone while torchrun restarts them."""
        if self.restarting_since is not None:
            return now - self.restarting_since
        return now - self.advanced

    def restart_bound(self) -> float:
        """The learned bound of a re-start (``restart_floor_s`` before any first start)."""
        first = self.first_start_s or 0.0
        return max(self.config.restart_floor_s, self.config.restart_factor * first)

    def timeout(self) -> float:
        phase = self.phase()
        if phase == STARTUP:
            return self.config.startup_timeout_s
        if phase == RESTART:
            return self.restart_bound()
        if phase == CHECKPOINT:
            return self.config.checkpoint_timeout_s
        if self.config.hang_timeout_s is not None:
            return self.config.hang_timeout_s
        if not self.intervals:
            return self.config.hang_floor_s
        return max(
            self.config.hang_floor_s, self.config.hang_factor * statistics.median(self.intervals)
        )

    def hung(self, now: float) -> bool:
        return self.age(now) > self.timeout()
