"""Whether a running attempt hangs, told from its ranks' heartbeats alone.

    clock = HangClock(config, intervals, now=time.monotonic())
    clock.observe(read_heartbeats(folder), now)      # each poll
    clock.hung(now), clock.age(now), clock.timeout()

The timeout is ``startup_timeout_s`` before the first heartbeat (and while no rank of the last
one runs: torchrun restarting its workers), ``checkpoint_timeout_s`` while a rank is in a
checkpoint, else ``hang_timeout_s``, or one learned from the observed intervals between
advances: ``hang_factor`` x their median, at least ``hang_floor_s``.
"""

from __future__ import annotations

import statistics
from collections import deque

from ...protocol import Beat
from .options import SupervisorConfig


class HangClock:
    """Decides whether an attempt hangs, from the beats it is shown over time.

    Args:
        config: the timeouts.
        intervals: observed seconds between advances, shared across attempts so a restarted
            job keeps the learned timeout.
        now: the attempt's start (monotonic seconds).
    """

    def __init__(self, config: SupervisorConfig, intervals: deque[float], now: float) -> None:
        self.config, self.intervals = config, intervals
        self.started = self.advanced = now
        self.beat: Beat | None = None
        self.between_workers = False
        """No rank of the last beat runs while the launcher does: torchrun is restarting its
        workers (an elastic restart, a rendezvous for peers), which is a start, not a hang."""

    def observe(self, beat: Beat | None, now: float) -> None:
        if beat is None or beat == self.beat:
            return
        if self.beat is not None and beat.step > self.beat.step:
            self.intervals.append(now - self.advanced)
        self.beat, self.advanced = beat, now

    def age(self, now: float) -> float:
        """Seconds since the last advance (since the start before the first beat)."""
        return now - self.advanced

    def timeout(self) -> float:
        if self.beat is None or self.between_workers:
            return self.config.startup_timeout_s
        if self.beat.checkpointing:
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
