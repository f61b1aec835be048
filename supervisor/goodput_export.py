"""The job's goodput as Prometheus series, served by node 0's supervisor.

    registry.register(GoodputCollector(checkpoint_dir))
    curl -s 127.0.0.1:9501/metrics | grep goodput

``torchvitals_supervisor_productive_seconds_total`` and
``torchvitals_supervisor_badput_seconds_total{cause}`` (counters, every cause of
``goodput.CAUSES`` always present) and ``torchvitals_supervisor_goodput_ratio`` (a gauge), from
``goodput.Accountant`` over the job's folder: a dashboard shows goodput over the job's life, an
alert fires when it drops.

A scrape reads cached figures: the folder is read again at most every ``refresh_s`` seconds (and
each step file only from where the last read stopped), so a fast scraper costs the job's disk
nothing more. The counters never go back: each series keeps the largest value it has served,
because a rule of the accounting may move a few seconds from one cause to another as an attempt's
record lands (a stalled attempt's startup becomes restart). Nothing raises into the scrape: a
failure is logged once and the last figures are served. Torch-free.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..records.goodput import CAUSES, Accountant, GoodputError
from .telemetry import SUPERVISOR_PREFIX

log = logging.getLogger("torchvitals.supervisor")

PRODUCTIVE = f"{SUPERVISOR_PREFIX}productive_seconds"
BADPUT = f"{SUPERVISOR_PREFIX}badput_seconds"
RATIO = f"{SUPERVISOR_PREFIX}goodput_ratio"
"""The series' names (prometheus_client adds ``_total`` to the counters)."""


class GoodputCollector(Collector):
    """The job's goodput, recomputed at most every ``refresh_s`` seconds.

    Args:
        folder: the job's folder (the shared checkpoint_dir, or the run folder).
        refresh_s: the least time between two reads of the folder.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        refresh_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not refresh_s >= 0:
            raise ValueError(f"refresh_s must be >= 0, got {refresh_s}")
        self._accountant = Accountant(folder)
        self.refresh_s, self._clock = refresh_s, clock
        self._read_at: float | None = None
        self._productive = 0.0
        self._badput = dict.fromkeys(CAUSES, 0.0)
        self._ratio: float | None = None
        self._failed = False
        self._lock = threading.Lock()  # two scrapes at once read the folder once

    def describe(self) -> Iterator[Metric]:
        # The names only: registering reads no folder.
        yield CounterMetricFamily(PRODUCTIVE, _PRODUCTIVE_HELP)
        yield CounterMetricFamily(BADPUT, _BADPUT_HELP, labels=["cause"])
        yield GaugeMetricFamily(RATIO, _RATIO_HELP)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at >= self.refresh_s:
                self._read_at = now
                self._refresh()
            productive, badput, ratio = self._productive, dict(self._badput), self._ratio
        yield CounterMetricFamily(PRODUCTIVE, _PRODUCTIVE_HELP, value=productive)
        family = CounterMetricFamily(BADPUT, _BADPUT_HELP, labels=["cause"])
        for cause in CAUSES:
            family.add_metric([cause], badput[cause])
        yield family
        if ratio is not None:  # no wall time yet: no ratio, rather than a 0 that would page
            yield GaugeMetricFamily(RATIO, _RATIO_HELP, value=ratio)

    def _refresh(self) -> None:
        try:
            figures = self._accountant.account()
        except GoodputError:
            return  # no records yet: the job has not started
        except Exception as exc:  # a scrape must never fail over the accounting
            if not self._failed:
                log.warning(
                    "torchvitals supervise: goodput of %s not computed (%s: %s); serving the "
                    "last figures",
                    self._accountant.folder,
                    type(exc).__name__,
                    exc,
                )
            self._failed = True
            return
        self._failed = False
        self._productive = max(self._productive, figures.productive_seconds)
        for cause in CAUSES:
            self._badput[cause] = max(self._badput[cause], figures.badput[cause])
        if figures.wall_seconds > 0:
            self._ratio = figures.goodput


_PRODUCTIVE_HELP = (
    "Seconds of the job's wall time spent on steps done for the first time, across every "
    "attempt (node 0's supervisor, from the job's goodput records)."
)
_BADPUT_HELP = (
    "Seconds of the job's wall time not spent productively, by cause (startup, checkpoint, "
    "detection, restart, lost_progress, skipped_update, rerun, data_wait, peers, teardown, "
    "unattributed)."
)
_RATIO_HELP = "Productive seconds over the job's wall time so far, across every attempt."
