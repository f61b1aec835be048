"""Global rank 0's step records for the goodput accounting (``torchvitals goodput DIR``).

    timeline = Timeline(StepTimeline(folder, attempt=2), at=time.time(), resumed=40,
                        load_seconds=1.2)                 # global rank 0, at watch()
    timeline.step(report, checkpoint_seconds=0.02)      # each step, after its action

The accounting splits the job's wall time into productive time and badput by cause; from the
agent it needs each step's end, its duration (since the previous step's end, the first since
``watch()`` returned), the part of it spent waiting for data, the part spent in checkpoints (a
save's stall on the step, a rollback's restore, a framework's own load before it) and the
action. One short JSON line, written and flushed on global rank 0 only
(``timeline.StepTimeline``, which logs a failing disk once and goes on): a few microseconds a
step, nothing on the other ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from ...records.timeline import StepTimeline
from ..report import Report


class Timeline:
    """The step records of one run on global rank 0.

    Args:
        timeline: where the lines go.
        at: unix seconds ``watch()`` returned.
        resumed: the step the run resumed from (0: a fresh start).
        load_seconds: the time spent loading that checkpoint at ``watch()``.
        clock: unix seconds.
    """

    def __init__(
        self,
        timeline: StepTimeline,
        *,
        at: float,
        resumed: int,
        load_seconds: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.timeline, self._clock, self._last = timeline, clock, at
        self._loaded = 0.0
        """Seconds of a checkpoint load since the last step line (a framework's own, after
        ``watch()``): the next step's checkpoint part."""
        timeline.start(at=at, resumed=resumed, load_seconds=load_seconds)

    def loaded(self, seconds: float) -> None:
        """A framework loaded its own checkpoint after ``watch()`` (torchtitan's) in ``seconds``:
        booked as checkpoint time of the step it delayed, not as that step's work."""
        if math.isfinite(seconds) and seconds > 0:
            self._loaded += seconds

    def step(self, report: Report, *, checkpoint_seconds: float = 0.0) -> None:
        """Record one step as it ended now (after its action, before the loop's next batch)."""
        end = self._clock()
        wait = report.timing.data_wait_seconds
        self.timeline.step(
            report.step,
            end=end,
            seconds=end - self._last,
            data_wait=wait if math.isfinite(wait) else 0.0,
            checkpoint=checkpoint_seconds + self._loaded,
            action=str(report.action),
            rerun=report.rerun.seconds if report.rerun is not None else 0.0,
        )
        self._last, self._loaded = end, 0.0

    def close(self) -> None:
        self.timeline.close()
