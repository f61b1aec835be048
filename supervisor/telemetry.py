"""The supervisor's own Prometheus metrics, each name defined here once.

torchvitals supervise --metrics-port 9501 -- CMD ...; curl -s 127.0.0.1:9501/metrics
(``--metrics-host`` binds another address: a pod's IP, for Prometheus.)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

SUPERVISOR_PREFIX = "torchvitals_supervisor_"
RESTART_REASONS = ("crash", "hang", "peer", "lost")
"""Every ``reason`` label of the supervisor's restart counter (peer: another node restarted the
job; lost: a node of the job was lost)."""


class SupervisorMetrics:
    """The supervisor's restarts, current attempt, heartbeat age, the incidents it wrote and,
    for a job of several nodes, which nodes are present, in ``registry``.

    Args:
        registry: where to register (default: a fresh registry).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.restarts = Counter(
            f"{SUPERVISOR_PREFIX}restarts",
            "Restarts of the supervised job, by reason "
            "(crash: non-zero exit; hang: heartbeat stalled; peer: another node's restart; lost: "
            "a node was lost).",
            ["reason"],
            registry=self.registry,
        )
        self.attempt = Gauge(
            f"{SUPERVISOR_PREFIX}attempt",
            "Current attempt of the supervised job (1 = first run).",
            registry=self.registry,
        )
        self.heartbeat_age = Gauge(
            f"{SUPERVISOR_PREFIX}heartbeat_age_seconds",
            "Seconds since the job's heartbeat last "
            "advanced (since the attempt started, before the first heartbeat).",
            registry=self.registry,
        )
        self.node_present = Gauge(
            f"{SUPERVISOR_PREFIX}node_present",
            "Whether this node of a multi-node job is "
            "present in the store (its supervisor holds its lease), labelled with its node "
            "rank; each node publishes its own, so a lost node's series goes stale with it.",
            ["node"],
            registry=self.registry,
        )
        self.nodes_present = Gauge(
            f"{SUPERVISOR_PREFIX}nodes_present",
            "Nodes of the job present in the store, as this node sees them.",
            registry=self.registry,
        )
        self.nodes_expected = Gauge(
            f"{SUPERVISOR_PREFIX}nodes_expected",
            "Nodes the job runs on (nnodes, fewer once "
            "it went on without a lost node); nodes_present below it: a node is missing.",
            registry=self.registry,
        )
        self.waiting_for_peers = Gauge(
            f"{SUPERVISOR_PREFIX}waiting_for_peers",
            "1 while this node waits for the other nodes "
            "at the start of an attempt (a phase of its own, never a hang), else 0.",
            registry=self.registry,
        )
        self.incidents = Counter(
            f"{SUPERVISOR_PREFIX}incidents",
            "Incidents this node's supervisor wrote into the job's folder (a hang, a crash, a "
            "lost node), by kind and culprit (global rank, node, host; empty where unknown); "
            "each incident is written by one node, so the sum over the nodes counts it once.",
            ["kind", "rank", "node", "host"],
            registry=self.registry,
        )
        for reason in RESTART_REASONS:
            self.restarts.labels(reason)
