"""The collector's own Prometheus metrics, each name defined here once.

    curl -s http://127.0.0.1:9500/metrics | grep ^torchvitals_collector_

Counters count since this collector process started (Prometheus handles the reset on restart);
the directive gauges are read from the store at scrape time, so they survive a restart.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from ..protocol import ACTIONS
from .directives import OUTCOMES, DirectiveStore

PREFIX = "torchvitals_collector_"

REJECT_REASONS = (
    "unauthorized",
    "body_too_large",
    "invalid_json",
    "unsupported_version",
    "missing_field",
    "invalid_field",
)
"""The ``reason`` labels of the rejection counter exposed at 0 from the start."""

LIMIT_REASONS = ("forbidden", "label_too_large", "too_many_jobs", "too_many_directives")
"""Further ``reason`` labels, exposed from their first occurrence (the set stays bounded: each
is a fixed code): a token used beyond its power, and the state's bounds."""


class _DirectiveGauges:
    """Pending and acknowledged directives, read from the store when scraped."""

    def __init__(self, store: DirectiveStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        # One family with a state label: a gauge named like a counter's base name
        # (directives_acknowledged) would be a second TYPE line for the same family.
        stats = self._store.stats()
        g = GaugeMetricFamily(
            f"{PREFIX}directives",
            "Directives in the store, pending, "
            "acknowledged or expired (kept across restarts until pruned).",
            labels=["state"],
        )
        for state in ("pending", "acknowledged", "expired"):
            g.add_metric([state], stats[state])
        yield g
        yield GaugeMetricFamily(
            f"{PREFIX}jobs",
            "Jobs the store holds directives or a run for (bounded by max_jobs).",
            value=stats["jobs"],
        )


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
            f"{PREFIX}webhooks_accepted", "Webhook notifications accepted.", registry=self.registry
        )
        self.webhooks_rejected = Counter(
            f"{PREFIX}webhooks_rejected",
            "Webhook notifications rejected, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.alerts = Counter(
            f"{PREFIX}alerts",
            "Alerts received in accepted notifications, by outcome "
            "(issued, duplicate, resolved, recorded).",
            ["outcome"],
            registry=self.registry,
        )
        self.directives_issued = Counter(
            f"{PREFIX}directives_issued",
            "Directives issued, by action.",
            ["action"],
            registry=self.registry,
        )
        self.directives_acknowledged = Counter(
            f"{PREFIX}directives_acknowledged",
            "Directives acknowledged by their job, by action.",
            ["action"],
            registry=self.registry,
        )
        # Zero series up front: a rate() over a reason that never happened reads 0, not nothing.
        for reason in REJECT_REASONS:
            self.webhooks_rejected.labels(reason)
        for outcome in OUTCOMES:
            self.alerts.labels(outcome)
        for action in ACTIONS:
            self.directives_issued.labels(action)
            self.directives_acknowledged.labels(action)
        self.registry.register(_DirectiveGauges(store))
