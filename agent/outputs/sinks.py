"""Where each step's report goes: this rank's /metrics, and on global rank 0 the event log and
the live view. All three read host values the step already has; none adds a sync."""

from __future__ import annotations

import math
import os
import time
from typing import Any

from ..config import Config
from ..detect.detector import Detector
from ..report import Report
from .eventlog import EventLog
from .exporter import Exporter
from .server import TLS


class Outputs:
    """The report's sinks, opened from the config and closed together.

    Args:
        config: the agent's settings (ports, log folder, live view).
        block_names: the blocks that get per-block series and rows.
        rank, world_size: this process's global rank and the job's size.
        registry: the Prometheus registry of the exporter (None: a fresh one).
    """

    def __init__(self, config: Config, block_names: list[str], *, rank: int, world_size: int,
                 registry: Any = None) -> None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        base = config.metrics_port
        tls = (TLS(certfile=config.metrics_certfile, keyfile=config.metrics_keyfile,
                   client_cafile=config.metrics_client_cafile,
                   client_auth_required=config.metrics_client_auth_required)
               if config.metrics_certfile else None)
        self.exporter = Exporter(block_names, rank=rank, local_rank=local_rank,
                                 world_size=world_size, port=base + local_rank if base else 0,
                                 host=config.metrics_host, registry=registry, tls=tls,
                                 max_connections=config.metrics_max_connections,
                                 idle_timeout_s=config.metrics_idle_timeout_s)
        self.events: EventLog | None = None
        self.run_dir: str | None = None
        if rank == 0 and config.log_dir:
            run = config.run_name or time.strftime("%Y%m%d-%H%M%S")
            self.run_dir = os.path.join(config.log_dir, run)
            self.events = EventLog(os.path.join(self.run_dir, "events.jsonl"),
                                   every=config.log_every)
        self.live = None
        if rank == 0 and config.live:
            from .live import LiveView
            # Plain lines: a status line every ~10 steps, on a sampled step (with its ratios).
            every = config.sample_every * math.ceil(10 / config.sample_every)
            self.live = LiveView(block_names, every=every,
                                 title=f"torchvitals  {self.exporter.url or ''}".rstrip())

    def publish(self, report: Report, detector: Detector,
                recovery: dict[str, float] | None) -> None:
        """Hand the step's report to every sink."""
        self.exporter.update(report, detector.active_counts(), recovery)
        if self.events is not None:
            self.events.write(report)
        if self.live is not None:
            self.live.update(report, detector.active.values(), recovery)

    def event(self, event: dict[str, Any]) -> None:
        """Log a non-step event (a validation loss) on global rank 0."""
        if self.events is not None:
            self.events.write_event(event)

    def close(self) -> None:
        self.exporter.close()
        if self.events is not None:
            self.events.close()
        if self.live is not None:
            self.live.close()
