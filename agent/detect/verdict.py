"""What detection produces: a Verdict, its severities, and the table of every pattern it can name.

    Verdict(LOSS_SPIKE, CRITICAL, step=118, block="blocks.3", evidence={"loss": 3.9, ...})

A leaf: it imports nothing of the package, so the report, the rules, the watchdog, the outputs
and the offline tools all share one spelling of each pattern and severity.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

INFO, WARNING, CRITICAL = "info", "warning", "critical"
SEVERITIES = (INFO, WARNING, CRITICAL)
"""``critical`` pages and makes the watchdog act; ``warning`` goes to a queue; ``info`` helps
troubleshooting."""

# Pattern names: the bounded label set of the metrics and alert rules, spelled once.
NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRAD = "nonfinite_grad"
LOSS_SPIKE = "loss_spike"
LOSS_OUTLIER = "loss_outlier"
GRAD_SPIKE = "grad_spike"
LOSS_DIVERGENCE = "loss_divergence"
GRAD_EXPLOSION = "grad_explosion"
LAYER_DIVERGENCE = "layer_divergence"
HOT_LR = "hot_lr"
DEAD_LAYER = "dead_layer"
VANISHING_GRADIENTS = "vanishing_gradients"
SATURATION = "saturation"
DEAD_RELU = "dead_relu"
ACTIVATION_EXPLOSION = "activation_explosion"
ATTENTION_SATURATION = "attention_saturation"
FP16_OVERFLOW = "fp16_overflow"
DEAD_PIPELINE = "dead_pipeline"
GENERALIZATION_GAP = "generalization_gap"
STRAGGLER = "straggler"
MEMORY_GROWTH = "memory_growth"
DATA_STALL = "data_stall"
REPLICA_DIVERGENCE = "replica_divergence"
TRANSIENT_FAULT = "transient_fault"
ROLLBACK_LOOP = "rollback_loop"
COLLECTOR_DIRECTIVE = "collector_directive"

PATTERNS: dict[str, str] = {
    NONFINITE_LOSS: CRITICAL,
    NONFINITE_GRAD: CRITICAL,
    LOSS_SPIKE: CRITICAL,
    LOSS_OUTLIER: WARNING,
    GRAD_SPIKE: WARNING,
    LOSS_DIVERGENCE: WARNING,
    GRAD_EXPLOSION: WARNING,
    LAYER_DIVERGENCE: WARNING,
    HOT_LR: WARNING,
    DEAD_LAYER: WARNING,
    VANISHING_GRADIENTS: WARNING,
    SATURATION: WARNING,
    DEAD_RELU: WARNING,
    ACTIVATION_EXPLOSION: WARNING,
    ATTENTION_SATURATION: WARNING,
    FP16_OVERFLOW: WARNING,
    DEAD_PIPELINE: WARNING,
    GENERALIZATION_GAP: WARNING,
    STRAGGLER: WARNING,
    MEMORY_GROWTH: WARNING,
    DATA_STALL: WARNING,
    REPLICA_DIVERGENCE: CRITICAL,
    TRANSIENT_FAULT: WARNING,
    ROLLBACK_LOOP: CRITICAL,
    COLLECTOR_DIRECTIVE: CRITICAL,
}
"""Every pattern the detector can name, with its severity (bounded label set for metrics)."""

PROCESS_PATTERNS = frozenset({STRAGGLER, MEMORY_GROWTH, DATA_STALL})
"""Warnings about the process, not the model: a slow rank, a leak, a slow loader leave the
weights as good as they were, so they do not make a step unhealthy for the watchdog (a slow node
that stays slow would otherwise stop every healthy checkpoint for the rest of the run)."""

OUTLIER_PATTERNS = frozenset({LOSS_OUTLIER, TRANSIENT_FAULT})
"""One step's loss far beyond its recent distribution, the next not yet known to be bad: with
the watchdog on, the step's update is dropped on every rank (``skip_outliers``), the cheapest
remedy; a second step past the loss threshold is a ``loss_spike`` and rolls back. A
``grad_spike`` only warns: a skipped update just before a sampled step would drop that sample's
update ratios, and with them the ``hot_lr`` warning a learning rate too hot first shows as.
A ``transient_fault`` (an outlier a re-run did not reproduce) is skipped the same way."""

RESPONSE_PATTERNS = frozenset({ROLLBACK_LOOP, COLLECTOR_DIRECTIVE})
"""What the job did about the other verdicts, not what went wrong: it gave up after too many
rollbacks, or it obeyed the collector's order. The diagnosis reports them beside the cause it
names from the symptoms, and no alert fires on their counters: the abort that ends a rollback
loop stops the process before a scrape can see the count rise (the abort incident and
TorchvitalsRollbacksTooFrequent page for it), and a directive answers an alert that already
fired."""


@dataclass(frozen=True)
class Verdict:
    """A named failure pattern, where it starts, how sure, and the numbers behind it."""

    pattern: str
    severity: str
    step: int
    block: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    """The values, the threshold that fired (by its Thresholds name) and the window."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = f" in {self.block}" if self.block else ""
        return f"[{self.severity}] step {self.step}: {self.pattern}{where}"
