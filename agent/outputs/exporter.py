"""Each rank's Prometheus /metrics endpoint, built at scrape time from the last step report.

Started by the agent (``torchvitals.watch``); to see what a rank serves:
``curl -s http://127.0.0.1:9400/metrics | grep ^torchvitals_``

Every rank exports its own scalars, labelled with its global ``rank``. Only global rank 0
exports the global and per-block series: the report's global fields are identical on every
rank, so one copy keeps the cardinality at blocks x metrics instead of ranks x blocks x metrics.
"""

from __future__ import annotations

import errno
import socket
import threading
from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...errors import ConfigError, TorchvitalsError
from ...protocol import ENV_PREFIX
from ..detect.verdict import PATTERNS
from ..measure.host import process_vitals
from ..report import Report
from .metrics import (BLOCK, GLOBAL, GROUP, METRICS, PATTERN, RANK, MetricSpec,  # noqa: F401
                      _Snapshot)
from .server import TLS, MetricsServer, RenderCache


class MetricsPortError(TorchvitalsError, OSError):
    """The /metrics endpoint could not bind its address (a taken port, a bad host)."""


class Exporter:
    """One rank's Prometheus endpoint; ``update`` caches, scrapes read the cache.

    Args:
        block_names: blocks that get per-block series (on global rank 0) from the first scrape on.
        rank: global rank, exported as the ``rank`` label.
        local_rank: rank on this host (named in the port error).
        world_size: ranks in the job.
        port: port to serve on (the setting plus LOCAL_RANK); 0 serves nothing.
        host: address to bind.
        registry: where the collector is registered (default: a fresh one, so two agents in one
            process do not clash). Pass ``prometheus_client.REGISTRY`` to serve your own metrics
            and the process_* ones on the same endpoint.
        port_setting: the Config field that sets the base port, for the error message.
        tls: serve HTTPS (and, with a client CA, check client certificates).
        max_connections, idle_timeout_s: the server's bounds (see ``outputs/server.py``).

    Raises:
        MetricsPortError: the port is taken or the host cannot be bound.
    """

    def __init__(self, block_names: list[str], *, rank: int, local_rank: int, world_size: int,
                 port: int, host: str = "127.0.0.1", registry: CollectorRegistry | None = None,
                 port_setting: str = "metrics_port", tls: TLS | None = None,
                 max_connections: int = 32, idle_timeout_s: float = 10.0) -> None:
        self.block_names = list(block_names)
        self.rank, self.host, self.port = rank, host, port
        self.registry = CollectorRegistry() if registry is None else registry
        self._lock = threading.Lock()
        self._world_size = world_size
        self._report: Report | None = None
        self._steps = self._skipped = self._nonfinite = 0
        self._update_ratio: dict[str, float] = {}
        self._activations: dict[str, dict[str, float]] = {}
        self._verdicts: dict[str, int] = {}
        self._active: dict[str, int] = {}
        self._recovery: dict[str, float] | None = None
        self._replica_checks = 0
        self._server: MetricsServer | None = None
        self.scheme = "https" if tls is not None else "http"
        self._collector = _ReportMetrics(self)
        self.registry.register(self._collector)
        self.cache = RenderCache(self._render, lambda: self._steps)
        """The rendered exposition (a scrape reads it; it is rendered once per step at most)."""
        if port == 0:
            return
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            self.registry.unregister(self._collector)
            raise ConfigError("metrics_host", host, f"an address or host name that resolves "
                              f"here ({exc.strerror or exc}); 127.0.0.1 serves this host only, "
                              f"0.0.0.0 every interface") from None
        try:
            self._server = MetricsServer(self.cache, host, port, tls=tls,
                                         max_connections=max_connections,
                                         idle_timeout_s=idle_timeout_s)
        except OSError as exc:
            self.registry.unregister(self._collector)
            taken = (" Another process (another job on this host?) holds the port."
                     if exc.errno == errno.EADDRINUSE else "")
            err = MetricsPortError(
                f"torchvitals cannot serve /metrics on {host}:{port} (rank {rank}, local rank "
                f"{local_rank}): {exc.strerror or exc}.{taken} Each rank serves on "
                f"{port_setting} + LOCAL_RANK = {port - local_rank} + {local_rank}. Set "
                f"{port_setting} (env {ENV_PREFIX}{port_setting.upper()}) to a free base port, "
                f"or to 0 to turn the endpoint off.")
            err.errno = exc.errno
            raise err from None

    @property
    def url(self) -> str | None:
        if self._server is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def update(self, report: Report, active: dict[str, int] | None = None,
               recovery: dict[str, float] | None = None) -> None:
        """Cache the step's report; called on the training thread, so it only swaps references.

        Args:
            report: the step's report (kept by reference, not copied).
            active: pattern -> number of currently active verdicts (the detector's view).
            recovery: the watchdog's numbers (rollbacks, lr_scale, ...), None without one.
        """
        verdicts = self._verdicts
        if self.rank == 0 and report.verdicts:
            verdicts = dict(verdicts)
            for v in report.verdicts:
                verdicts[v.pattern] = verdicts.get(v.pattern, 0) + 1
        ratio, acts = self._update_ratio, self._activations
        # Only rank 0 exports per-block series. Sampled steps may cover only some blocks (the
        # update ratio takes turns under its memory bound), so keep each block's last value;
        # new dicts, never mutated, so a scrape can read them without the lock.
        if self.rank == 0 and report.update_ratio:
            ratio = {**ratio, **report.update_ratio}
        if self.rank == 0 and report.activations:
            acts = {**acts, **report.activations}
        with self._lock:
            self._report = report
            self._steps += 1
            self._skipped += report.action == "skip"
            self._nonfinite += bool(report.nonfinite)
            self._replica_checks += report.replicas_checked
            self._update_ratio, self._activations = ratio, acts
            self._verdicts = verdicts
            if active is not None:
                self._active = active
            self._recovery = recovery

    def _render(self, accept: str) -> tuple[bytes, str]:
        """The registry's exposition text in the format ``accept`` asks for (scrape thread)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def _snapshot(self) -> _Snapshot:
        host = process_vitals()      # on the scrape thread, outside the lock: training never waits
        with self._lock:
            return _Snapshot(self._report, self._steps, self._skipped, self._nonfinite,
                             self._world_size, self._update_ratio, self._activations,
                             self._verdicts, self._active, self._recovery, self._replica_checks,
                             host)

    def close(self) -> None:
        """Stop serving and unregister the collector; safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        if self._collector is not None:
            self.registry.unregister(self._collector)
            self._collector = None


class _ReportMetrics(Collector):
    """Builds the metric families from the exporter's cached state at scrape time."""

    def __init__(self, exporter: Exporter) -> None:
        self._exporter = exporter

    def _specs(self) -> list[MetricSpec]:
        rank0 = self._exporter.rank == 0
        return [m for m in METRICS if m.scope == RANK or rank0]

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering two exporters in one registry fails loudly.
        for m in self._specs():
            yield _family(m, ())

    def collect(self) -> Iterator[Metric]:
        ex = self._exporter
        snap = ex._snapshot()
        rank = str(ex.rank)
        blocks = _block_names(ex.block_names, snap)
        for m in self._specs():
            if m.scope == BLOCK:
                family = _family(m, ("rank", "block"))
                for block in blocks:
                    family.add_metric([rank, block], m.value(snap, block))
            elif m.scope == PATTERN:
                family = _family(m, ("rank", "pattern", "severity"))
                for pattern, severity in PATTERNS.items():
                    family.add_metric([rank, pattern, severity], m.value(snap, pattern))
            elif m.scope == GROUP:
                family = _family(m, ("rank", "param_group"))
                for group in range(len(snap.report.lr) if snap.report is not None else 0):
                    family.add_metric([rank, str(group)], m.value(snap, group))
            else:
                value = m.value(snap)
                if value is None:
                    continue
                family = _family(m, ("rank",) + tuple(k for k, _ in m.labels))
                family.add_metric([rank] + [v for _, v in m.labels], value)
            yield family


def _block_names(named: list[str], snap: _Snapshot) -> list[str]:
    """The named blocks, then any block a report measured that the caller did not name."""
    blocks = dict.fromkeys(named)
    if snap.report is not None:
        blocks.update(dict.fromkeys(snap.report.grad_norm))
    blocks.update(dict.fromkeys(snap.update_ratio))
    blocks.update(dict.fromkeys(snap.activations))
    return list(blocks)


def _family(m: MetricSpec, labels: tuple[str, ...]) -> Metric:
    kind = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
    return kind(m.name, m.doc, labels=labels)
