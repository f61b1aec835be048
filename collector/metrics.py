"""The collector's own Prometheus metrics, each name defined here once.

    curl -s http://127.0.0.1:9500/metrics | grep ^torchvitals_collector_

Counters count since this collector process started (Prometheus handles the reset on restart);
the directive gauges are read from the store at scrape time, so they survive a restart.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from .directives import OUTCOMES, DirectiveStore
from .webhook import ACTIONS

PREFIX = "torchvitals_collector_"

REJECT_REASONS = ("unauthorized", "body_too_large", "invalid_json", "unsupported_version",
                  "missing_field", "invalid_field")
"""Every ``reason`` label of the rejection counter (bounded: each is a fixed code)."""


class _StoreCollector:
    """Pending and acknowledged directives, read from the store when scraped."""

    def __init__(self, store: DirectiveStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        # One family with a state label: a gauge named like a counter's base name
        # (directives_acknowledged) would be a second TYPE line for the same family.
        g = GaugeMetricFamily(f"{PREFIX}directives", "Directives in the store, pending or "
                              "acknowledged (kept across restarts).", labels=["state"])
        for state, n in self._store.counts().items():
            g.add_metric([state], n)
        yield g


class CollectorMetrics:
    """The collector's counters, registered in ``registry``.

    Args:
        store: the directive store the gauges read.
        registry: where to register (default: a fresh registry, so tests and several
            collectors in one process never collide).
    """

    def __init__(self, store: DirectiveStore, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.webhooks_accepted = Counter(
            f"{PREFIX}webhooks_accepted", "Webhook notifications accepted.",
            registry=self.registry)
        self.webhooks_rejected = Counter(
            f"{PREFIX}webhooks_rejected", "Webhook notifications rejected, by reason.",
            ["reason"], registry=self.registry)
        self.alerts = Counter(
            f"{PREFIX}alerts", "Alerts received in accepted notifications, by outcome "
            "(issued, duplicate, resolved, recorded).", ["outcome"], registry=self.registry)
        self.directives_issued = Counter(
            f"{PREFIX}directives_issued", "Directives issued, by action.", ["action"],
            registry=self.registry)
        self.directives_acknowledged = Counter(
            f"{PREFIX}directives_acknowledged", "Directives acknowledged by their job, by action.",
            ["action"], registry=self.registry)
        # Zero series up front: a rate() over a reason that never happened reads 0, not nothing.
        for reason in REJECT_REASONS:
            self.webhooks_rejected.labels(reason)
        for outcome in OUTCOMES:
            self.alerts.labels(outcome)
        for action in ACTIONS:
            self.directives_issued.labels(action)
            self.directives_acknowledged.labels(action)
        self.registry.register(_StoreCollector(store))


SUPERVISOR_PREFIX = "torchvitals_supervisor_"
RESTART_REASONS = ("crash", "hang")
"""Every ``reason`` label of the supervisor's restart counter."""


class SupervisorMetrics:
    """The supervisor's restarts, current attempt and heartbeat age, in ``registry``.

    Args:
        registry: where to register (default: a fresh registry).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import Gauge
        self.registry = CollectorRegistry() if registry is None else registry
        self.restarts = Counter(
            f"{SUPERVISOR_PREFIX}restarts", "Restarts of the supervised job, by reason "
            "(crash: non-zero exit; hang: heartbeat stalled).", ["reason"], registry=self.registry)
        self.attempt = Gauge(
            f"{SUPERVISOR_PREFIX}attempt", "Current attempt of the supervised job (1 = first run).",
            registry=self.registry)
        self.heartbeat_age = Gauge(
            f"{SUPERVISOR_PREFIX}heartbeat_age_seconds", "Seconds since the job's heartbeat last "
            "advanced (since the attempt started, before the first heartbeat).",
            registry=self.registry)
        for reason in RESTART_REASONS:
            self.restarts.labels(reason)
