"""Each rank's Prometheus /metrics endpoint, built at scrape time from the last step report.

Started by the agent (``torchvitals.watch``); to see what a rank serves:
``curl -s http://127.0.0.1:19400/metrics | grep ^torchvitals_``

Every rank exports its own scalars, labelled with its global ``rank``. Only global rank 0
exports the global and per-block series: the report's global fields are identical on every
rank, so one copy keeps the cardinality at blocks x metrics instead of ranks x blocks x metrics.
"""

from __future__ import annotations

import bisect
import errno
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ...errors import ConfigError, TorchvitalsError
from ...protocol import ENV_PREFIX
from ..detect.verdict import PATTERNS
from ..measure.host import process_vitals
from ..report import Action, Report
from .metrics import (
    BLOCK,
    CUSTOM,
    GROUP,
    INCIDENT,
    INCIDENT_LABELS,
    METRICS,
    PATTERN,
    RANK,
    Buckets,
    MetricSpec,
    _Snapshot,
)
from .ports import candidates
from .ratelimit import ScrapeBudget, ScrapeLimit
from .render import RenderCache
from .server import MetricsServer
from .tls import TLS

log = logging.getLogger(__name__)

_WILDCARD = ("0.0.0.0", "::", "")

_TAKEN = (errno.EADDRINUSE, errno.EACCES)
"""Bind errors another port may not have (busy; below 1024 without the right)."""


class MetricsPortError(TorchvitalsError, OSError):
    """The /metrics endpoint could not bind its address (a taken port, a bad host)."""


class Exporter:
    """One rank's Prometheus endpoint; ``update`` caches, scrapes read the cache.

    Args:
        block_names: blocks that get per-block series (on global rank 0) from the first scrape on.
        rank: global rank, exported as the ``rank`` label.
        local_rank: rank on this host (named in the port error).
        world_size: ranks in the job.
        port: port to try first (the setting plus the local rank); 0 serves nothing.
        host: address to bind.
        registry: where the collector is registered (default: a fresh one, so two agents in one
            process do not clash). Pass ``prometheus_client.REGISTRY`` to serve your own metrics
            and the process_* ones on the same endpoint.
        port_setting: the Config field that sets the base port, for the error message.
        tls: serve HTTPS (and, with a client CA, check client certificates).
        max_connections, idle_timeout_s: the server's bounds (see ``outputs/server.py``).
        limit: each client address's scrapes a second, beyond which it gets 429 (see
            ``outputs/ratelimit.py``); None: no limit.
        strict: a port that cannot be bound raises ``MetricsPortError``. Otherwise a taken port
            is one warning and the next of ``ports.candidates`` (a node-width further, then any
            free port), and an address this host lacks serves nothing, with a warning: the
            monitoring never stops the training. ``url`` and ``port`` say what is served.
        local_size: ranks on this host (the fallback's stride).

    Raises:
        MetricsPortError: strict, and the port is taken or the host cannot be bound.
        ConfigError: ``host`` does not resolve.
    """

    def __init__(
        self,
        block_names: list[str],
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        port: int,
        host: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
        port_setting: str = "metrics_port",
        tls: TLS | None = None,
        max_connections: int = 32,
        idle_timeout_s: float = 10.0,
        limit: ScrapeLimit | None = ScrapeLimit(),  # noqa: B008  # frozen: shared safely
        strict: bool = False,
        local_size: int = 1,
    ) -> None:
        self.block_names = list(block_names)
        self.rank, self.host, self.port = rank, host, port
        self.registry = CollectorRegistry() if registry is None else registry
        self._lock = threading.Lock()
        self._world_size = world_size
        self._report: Report | None = None
        self._steps = self._skipped = self._nonfinite = 0
        self._update_ratio: dict[str, float] = {}
        self._activations: dict[str, dict[str, float]] = {}
        self._custom: dict[str, float] = {}
        self._verdicts: dict[str, int] = {}
        self._active: dict[str, int] = {}
        self._recovery: dict[str, float] | None = None
        self._replica_checks = 0
        self._incidents: dict[tuple[str, str, str, str], int] = {}
        # Each histogram's per-bucket counts and sum; each report-summed counter's total.
        self._observed = [m for m in METRICS if m.kind == "histogram"]
        self._summed = [m for m in METRICS if m.from_report]
        self._counts = {m.name: [0] * len(m.buckets) for m in self._observed}
        self._sums = {m.name: 0.0 for m in self._observed}
        self._totals: dict[str, float] = {}
        self._server: MetricsServer | None = None
        self.scheme = "https" if tls is not None else "http"
        self._collector: _ReportMetrics | None = _ReportMetrics(self)
        self.registry.register(self._collector)
        self.cache = RenderCache(self._render, lambda: self._steps)
        """The rendered exposition (a scrape reads it; it is rendered once per step at most)."""
        if port == 0:
            return
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            self.registry.unregister(self._collector)
            raise ConfigError(
                "metrics_host",
                host,
                f"an address or host name that resolves "
                f"here ({exc.strerror or exc}); 127.0.0.1 serves this host only, "
                f"0.0.0.0 every interface",
            ) from None
        tried: list[int] = []
        for candidate in candidates(port - local_rank, local_rank, local_size):
            try:
                self._server = MetricsServer(
                    self.cache,
                    host,
                    candidate,
                    tls=tls,
                    max_connections=max_connections,
                    idle_timeout_s=idle_timeout_s,
                    budget=None if limit is None else ScrapeBudget(limit),
                )
                break
            except OSError as exc:
                err = self._bind_error(exc, host, port, rank, local_rank, port_setting)
                if strict:
                    self.registry.unregister(self._collector)
                    raise err from None
                if exc.errno not in _TAKEN:
                    # Not a busy port (an address this host does not have, say): no other port
                    # would bind either. The training goes on; nothing is served, loudly.
                    log.warning(
                        "%s Serving no /metrics on this rank; the training goes on "
                        "(metrics_port_strict=True makes this an error).",
                        err,
                    )
                    return
                tried.append(candidate)
        assert self._server is not None  # the last candidate, port 0, always binds
        self.port = self._server.port
        if tried:
            log.warning(
                "torchvitals: /metrics port %s on %s is taken (rank %d, local rank %d; "
                "dcgm-exporter holds 9400, node-exporter 9100); serving on %s instead. Set "
                "%s (env %s%s) to a free base port, or metrics_port_strict=True to make a taken "
                "port an error.",
                ", ".join(map(str, tried)),
                host,
                rank,
                local_rank,
                self.url,
                port_setting,
                ENV_PREFIX,
                port_setting.upper(),
            )

    def _bind_error(
        self, exc: OSError, host: str, port: int, rank: int, local_rank: int, port_setting: str
    ) -> MetricsPortError:
        """The strict mode's error for the configured port (the message the fallback logs)."""
        taken = (
            " Another process (another job on this host, dcgm-exporter?) holds the port."
            if exc.errno == errno.EADDRINUSE
            else ""
        )
        err = MetricsPortError(
            f"torchvitals cannot serve /metrics on {host}:{port} (rank {rank}, local rank "
            f"{local_rank}): {exc.strerror or exc}.{taken} Each rank serves on "
            f"{port_setting} + LOCAL_RANK = {port - local_rank} + {local_rank}. Set "
            f"{port_setting} (env {ENV_PREFIX}{port_setting.upper()}) to a free base port, "
            f"or to 0 to turn the endpoint off."
        )
        err.errno = exc.errno
        return err

    @property
    def url(self) -> str | None:
        """The URL this rank really serves (after any fallback), None when it serves nothing.

        Bound to every interface (0.0.0.0, ::), it names the host, which is what a scraper on
        another machine can reach.
        """
        if self._server is None:
            return None
        host = socket.gethostname() if self.host in _WILDCARD else self.host
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    @property
    def target(self) -> str | None:
        """``host:port`` of ``url``, as a Prometheus scrape target names it."""
        url = self.url
        return None if url is None else url.split("://", 1)[1].rsplit("/metrics", 1)[0]

    def update(
        self,
        report: Report,
        active: dict[str, int] | None = None,
        recovery: dict[str, float] | None = None,
    ) -> None:
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
        custom = {**self._custom, **report.custom} if report.custom else self._custom
        observed = [(m.name, m.buckets, m.value(report)) for m in self._observed]
        summed = [(m.name, m.value(report)) for m in self._summed]
        with self._lock:
            for name, bounds, x in observed:
                if x is not None:
                    self._counts[name][bisect.bisect_left(bounds, x)] += 1
                    self._sums[name] += x
            for name, inc in summed:
                if inc is not None:
                    self._totals[name] = self._totals.get(name, 0.0) + inc
            self._report = report
            self._steps += 1
            self._skipped += report.action == Action.SKIP
            self._nonfinite += bool(report.nonfinite)
            self._replica_checks += report.replicas.checked
            self._update_ratio, self._activations = ratio, acts
            self._custom = custom
            self._verdicts = verdicts
            if active is not None:
                self._active = active
            self._recovery = recovery

    def count_incident(self, kind: str, rank: Any, node: Any, host: Any) -> None:
        """One more incident of ``kind`` caused by the culprit (None: "" as its label)."""
        labels = (kind, _label(rank), _label(node), _label(host))
        with self._lock:
            counts = dict(self._incidents)  # a new dict: a scrape reads it without the lock
            counts[labels] = counts.get(labels, 0) + 1
            self._incidents = counts

    def _render(self, accept: str) -> tuple[bytes, str]:
        """The registry's exposition text in the format ``accept`` asks for (scrape thread)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def _snapshot(self) -> _Snapshot:
        host = process_vitals()  # on the scrape thread, outside the lock: training never waits
        server = self._server  # once: close() may drop it meanwhile
        with self._lock:
            histograms = {
                m.name: Buckets(m.buckets, tuple(self._counts[m.name]), self._sums[m.name])
                for m in self._observed
            }
            return _Snapshot(
                self._report,
                self._steps,
                self._skipped,
                self._nonfinite,
                self._world_size,
                self._update_ratio,
                self._activations,
                self._verdicts,
                self._active,
                self._recovery,
                self._replica_checks,
                host,
                histograms,
                dict(self._totals),
                self._custom,
                self._incidents,
                0 if server is None else server.refused,
            )

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
            if m.kind == "histogram":  # every histogram is a RANK one
                histogram = HistogramMetricFamily(m.name, m.doc, labels=("rank",))
                buckets = snap.histograms[m.name]
                histogram.add_metric([rank], buckets.cumulative(), buckets.total)
                yield histogram
                continue
            if m.scope == BLOCK:
                family = _value_family(m, ("rank", "block"))
                for block in blocks:
                    _add(family, [rank, block], m.value(snap, block))
            elif m.scope == PATTERN:
                family = _value_family(m, ("rank", "pattern", "severity"))
                for pattern, severity in PATTERNS.items():
                    _add(family, [rank, pattern, severity], m.value(snap, pattern))
            elif m.scope == CUSTOM:
                family = _value_family(m, ("rank", "name"))
                for name in snap.custom:
                    _add(family, [rank, name], m.value(snap, name))
            elif m.scope == INCIDENT:
                family = _value_family(m, INCIDENT_LABELS)
                for labels in snap.incidents:
                    _add(family, list(labels), m.value(snap, labels))
            elif m.scope == GROUP:
                family = _value_family(m, ("rank", "param_group"))
                for group in range(len(snap.report.lr) if snap.report is not None else 0):
                    _add(family, [rank, str(group)], m.value(snap, group))
            else:
                value = snap.totals.get(m.name) if m.from_report else m.value(snap)
                if value is None:
                    continue
                family = _value_family(m, ("rank", *(k for k, _ in m.labels)))
                family.add_metric([rank] + [v for _, v in m.labels], value)
            yield family


def _label(value: Any) -> str:
    return "" if value is None else str(value)


def _block_names(named: list[str], snap: _Snapshot) -> list[str]:
    """The named blocks, then any block a report measured that the caller did not name."""
    blocks = dict.fromkeys(named)
    if snap.report is not None:
        blocks.update(dict.fromkeys(snap.report.grad_norm))
    blocks.update(dict.fromkeys(snap.update_ratio))
    blocks.update(dict.fromkeys(snap.activations))
    return list(blocks)


def _add(
    family: CounterMetricFamily | GaugeMetricFamily, labels: list[str], value: float | None
) -> None:
    """One keyed series; a None value omits it (as ``MetricSpec.value`` says)."""
    if value is not None:
        family.add_metric(labels, value)


def _family(m: MetricSpec, labels: tuple[str, ...]) -> Metric:
    if m.kind == "histogram":
        return HistogramMetricFamily(m.name, m.doc, labels=labels)
    return _value_family(m, labels)


def _value_family(
    m: MetricSpec, labels: tuple[str, ...]
) -> CounterMetricFamily | GaugeMetricFamily:
    """A counter's or a gauge's family (a histogram's is built where its buckets are read)."""
    kind = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
    return kind(m.name, m.doc, labels=labels)
