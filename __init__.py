"""torchvitals: vital signs, failure detection and rollback for distributed PyTorch training.

    import torchvitals
    agent = torchvitals.watch(model, optimizer, scheduler)
    ...
    loss.backward()
    report = agent.step(loss)

The package reads as the pipeline of one training step, one folder a stage:

- ``agent/`` runs inside each rank: ``measure/`` (blocks, gradient, update and activation
  statistics, the packed reduction) -> ``detect/`` (verdicts) -> ``recover/`` (watchdog,
  checkpoints, ledger, batches, heartbeat, directives) -> ``outputs/`` (/metrics, event log,
  live view); ``tools/`` are the offline commands (diagnose, report, preflight, demo).
- ``collector/`` runs beside the job: the Alertmanager webhook service, and ``supervisor/``,
  which restarts a job that crashes or hangs.
- ``protocol`` holds the contracts between the two sides (environment names, heartbeat files,
  directive codes, the token, exit codes), ``settings`` how flags and ``TORCHVITALS_*``
  variables reach a config, ``errors`` the base exception.

The names below load on first use, so the collector, the supervisor and the offline readers
(``torchvitals diagnose``/``report``) start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import TorchvitalsError
from .lazy import lazy_exports

_EXPORTS = {
    "Agent": ".agent.agent", "watch": ".agent.agent", "Config": ".agent.config",
    "Report": ".agent.report", "record_attention": ".agent.measure.attention",
    "Thresholds": ".agent.detect.thresholds", "Verdict": ".agent.detect.verdict",
    "TrainingAborted": ".agent.recover.watchdog",
    "LightningCallback": ".agent.integrations.lightning",
    "TransformersCallback": ".agent.integrations.transformers",
    "watch_torchtitan": ".agent.integrations.torchtitan",
}
__all__ = sorted([*_EXPORTS, "TorchvitalsError"])

if TYPE_CHECKING:
    from .agent.agent import Agent, watch
    from .agent.config import Config
    from .agent.detect.thresholds import Thresholds
    from .agent.detect.verdict import Verdict
    from .agent.integrations.lightning import LightningCallback
    from .agent.integrations.torchtitan import watch_torchtitan
    from .agent.integrations.transformers import TransformersCallback
    from .agent.measure.attention import record_attention
    from .agent.recover.watchdog import TrainingAborted
    from .agent.report import Report

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
