"""Where each step's report goes: this rank's /metrics, on global rank 0 the event log and
the live view, and the user's own sinks (``watch(sinks=[...])``, a ``Sink`` each). All read
host values the step already has; none adds a sync.

The sinks are guests in the training loop: after ``watch()`` returned, a sink that fails (a full
disk under the event log, a closed terminal under the live view) is logged once with its
traceback and then counted, and the step goes on. Only a setting that cannot work fails, and it
fails at ``watch()``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..config import Config
from ..detect.detector import Detector
from ..report import Report
from .discovery import TargetFile
from .eventlog import EventLog
from .exporter import Exporter
from .ports import local_rank, local_rank_source, local_size
from .ratelimit import ScrapeLimit
from .tls import TLS

log = logging.getLogger(__name__)


class Sink:
    """Somewhere a step's report goes (the public extension point: ``torchvitals.Sink``).

    A user's sink runs on every rank, after the agent's own, with the report every rank agreed
    on (its ``local_*`` fields are this rank's; publish on rank 0 alone if the sink should write
    once per job). Host values only: ``publish`` must not start a collective or wait on the
    device. A sink that raises is logged once with its traceback, then counted
    (``Outputs.failures``), and the training goes on. The defaults do nothing.

    Attributes:
        name: what the log and ``Outputs.failures`` call it (default: the class name).
    """

    name: str = ""

    def publish(self, report: Report) -> None:
        """Take one step's report (called once per step, after detection and the action)."""

    def close(self) -> None:
        """Flush and release what the sink holds (called once, at ``agent.close()``)."""


def sink_name(sink: Sink) -> str:
    return sink.name or type(sink).__name__


class Outputs:
    """The report's sinks, opened from the config and closed together.

    Args:
        config: the agent's settings (ports, log folder, live view).
        block_names: the blocks that get per-block series and rows.
        rank, world_size: this process's global rank and the job's size.
        registry: the Prometheus registry of the exporter (None: a fresh one).
        sinks: the user's own sinks, published to after the agent's.
    """

    def __init__(
        self,
        config: Config,
        block_names: list[str],
        *,
        rank: int,
        world_size: int,
        registry: Any = None,
        sinks: Sequence[Sink] = (),
    ) -> None:
        for sink in sinks:
            if not callable(getattr(sink, "publish", None)):
                raise TypeError(
                    f"watch(sinks=...) takes torchvitals.Sink instances (a publish(report) "
                    f"method), not {type(sink).__name__}"
                )
        self.sinks = [(sink_name(sink), sink) for sink in sinks]
        """The user's sinks and the names their failures are counted under."""
        local = local_rank()
        base = config.metrics_port
        tls = (
            TLS(
                certfile=config.metrics_certfile,
                keyfile=config.metrics_keyfile,
                client_cafile=config.metrics_client_cafile,
                client_auth_required=config.metrics_client_auth_required,
            )
            if config.metrics_certfile
            else None
        )
        self.exporter = Exporter(
            block_names,
            rank=rank,
            local_rank=local,
            world_size=world_size,
            port=base + local if base else 0,
            host=config.metrics_host,
            registry=registry,
            tls=tls,
            max_connections=config.metrics_max_connections,
            idle_timeout_s=config.metrics_idle_timeout_s,
            limit=(
                ScrapeLimit(
                    scrapes_per_s=config.metrics_scrapes_per_s, burst=config.metrics_scrape_burst
                )
                if config.metrics_scrapes_per_s
                else None
            ),
            strict=config.metrics_port_strict,
            local_size=local_size(),
        )
        if self.exporter.url is not None:
            log.info(
                "torchvitals: rank %d (local rank %d, from %s) serves /metrics at %s",
                rank,
                local,
                local_rank_source() or "no launcher variable",
                self.exporter.url,
            )
        self.failures: dict[str, int] = {}
        """Sink name -> calls that raised (each sink's first failure is logged in full)."""
        self.target: TargetFile | None = None
        if config.metrics_file_sd_dir and self.exporter.target is not None:
            self.target = TargetFile(config.metrics_file_sd_dir, rank)
            self.target.write(
                self.exporter.target,
                self.exporter.scheme,
                job=config.collector_job if config.collector_url else None,
            )
        self.events: EventLog | None = None
        self.run_dir: str | None = None
        if rank == 0 and config.log_dir:
            run = config.run_name or time.strftime("%Y%m%d-%H%M%S")
            self.run_dir = os.path.join(config.log_dir, run)
            self.events = EventLog(
                os.path.join(self.run_dir, "events.jsonl"), every=config.log_every
            )
        self.live = None
        if rank == 0 and config.live:
            from .live import LiveView

            # Plain lines: a status line every ~10 steps, on a sampled step (with its ratios).
            every = config.sample_every * math.ceil(10 / config.sample_every)
            self.live = LiveView(
                block_names, every=every, title=f"torchvitals  {self.exporter.url or ''}".rstrip()
            )

    @property
    def metrics_url(self) -> str | None:
        """The URL this rank's /metrics really serves (None: it serves none)."""
        return self.exporter.url

    def publish(
        self, report: Report, detector: Detector, recovery: dict[str, float] | None
    ) -> None:
        """Hand the step's report to every sink; never raises."""
        self._guarded("metrics", self.exporter.update, report, detector.active_counts(), recovery)
        if self.events is not None:
            self._guarded("event log", self.events.write, report)
        if self.live is not None:
            self._guarded("live view", self.live.update, report, detector.active.values(), recovery)
        for name, sink in self.sinks:
            self._guarded(name, sink.publish, report)

    def event(self, event: dict[str, Any]) -> None:
        """Log a non-step event (a validation loss) on global rank 0; never raises."""
        if self.events is not None:
            self._guarded("event log", self.events.write_event, event)

    def _guarded(self, sink: str, call: Callable[..., Any], *args: Any) -> None:
        try:
            call(*args)
        except Exception:  # a sink must never stop the training
            count = self.failures[sink] = self.failures.get(sink, 0) + 1
            if count == 1:
                log.warning(
                    "torchvitals: the %s failed; the training goes on without it (later "
                    "failures are counted, not logged)",
                    sink,
                    exc_info=True,
                )

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []  # closed once: close() and the finalizer both call
        for name, sink in sinks:
            self._guarded(name, sink.close)
        if self.target is not None:
            self.target.remove()
        self.exporter.close()
        if self.events is not None:
            self.events.close()
        if self.live is not None:
            self.live.close()
