"""torchvitals: vital signs, failure detection and rollback for distributed PyTorch training.

    import torchvitals
    agent = torchvitals.watch(model, optimizer, scheduler)
    ...
    loss.backward()
    report = agent.step(loss)

The names below load on first use, so the collector and the supervisor (``torchvitals.collector``)
import without torch: their image and their start-up do not carry it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .agent.lazy import lazy_exports

_EXPORTS = {
    "Agent": ".agent.agent", "watch": ".agent.agent", "Config": ".agent.config",
    "Report": ".agent.report", "record_attention": ".agent.attention",
    "Thresholds": ".agent.detect", "Verdict": ".agent.detect",
    "TrainingAborted": ".agent.watchdog",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .agent.agent import Agent, watch
    from .agent.attention import record_attention
    from .agent.config import Config
    from .agent.detect import Thresholds, Verdict
    from .agent.report import Report
    from .agent.watchdog import TrainingAborted

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
