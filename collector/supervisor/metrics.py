"""The supervisor's own Prometheus metrics, each name defined here once.

    torchvitals supervise --metrics-port 9501 -- CMD ...; curl -s 127.0.0.1:9501/metrics
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

SUPERVISOR_PREFIX = "torchvitals_supervisor_"
RESTART_REASONS = ("crash", "hang")
"""Every ``reason`` label of the supervisor's restart counter."""


class SupervisorMetrics:
    """The supervisor's restarts, current attempt and heartbeat age, in ``registry``.

    Args:
        registry: where to register (default: a fresh registry).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
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
