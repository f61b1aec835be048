"""The words the job's records use: what every rank did with a step, the kinds of incident.

Spelled once here; the agent's report, the incidents, the timeline and the goodput accounting
import them, and the metrics and alert rules use the same strings as label values.
"""

from __future__ import annotations

import enum


class Action(str, enum.Enum):
    """What every rank did with the step. A ``str``: ``report.action == "rollback"`` holds, and
    JSON writes the value."""

    STEP = "step"
    """The optimizer stepped."""
    SKIP = "skip"
    """No optimizer step on any rank."""
    ROLLBACK = "rollback"
    """Every rank restored the last healthy checkpoint (see ``Report.rollback``)."""
    ABORT = "abort"
    """The loop guard or a collector's order gave up on the run."""

    def __str__(self) -> str:
        return self.value


RERUN = "rerun"
"""The remedy of a suspect step computed once more that did not reproduce (a transient fault):
its update is dropped, like an outlier's, and the incident is a ``transient`` one."""

REMEDIES = {
    Action.STEP: "none",
    Action.SKIP: "skip_update",
    Action.ROLLBACK: "rollback",
    Action.ABORT: "abort",
}
"""The remedy each action is, in the ladder's words: a skipped step used its batch and dropped
only its update (the skipped *batches* are a rollback's, never trained on)."""


HANG, CRASH, NODE_LOST = "hang", "crash", "node_lost"
"""The supervisor's incidents: the job stopped making progress, a process died, a node left."""
NONFINITE, LOSS_SPIKE, STRAGGLER, DIVERGENCE = "nonfinite", "loss_spike", "straggler", "divergence"
"""The agent's incidents: a verdict's pattern (or a rollback it caused)."""
TRANSIENT = "transient"
"""The agent's incident for a suspect step that a re-run did not reproduce (a flipped bit, a
bad kernel, a failing accelerator), naming the rank whose value changed."""
ABORT = Action.ABORT.value
"""The job gave up on purpose: the report's action of that step."""
KINDS = (HANG, CRASH, NODE_LOST, NONFINITE, LOSS_SPIKE, STRAGGLER, DIVERGENCE, TRANSIENT, ABORT)
"""Every kind of incident (a bounded label set: the metrics and alerts use it too)."""
FAULT_KINDS = frozenset({HANG, CRASH, NODE_LOST, ABORT})
"""The kinds whose cost is a restart: the goodput accounting charges them to ``fault``."""
ROLLBACK_KINDS = frozenset({NONFINITE, LOSS_SPIKE, DIVERGENCE})
"""The kinds the watchdog answers with a rollback: charged to ``rollback``."""
