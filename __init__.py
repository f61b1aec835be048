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
- ``collector/`` runs beside the job: the Alertmanager webhook service.
- ``supervisor/`` runs on every node: ``torchvitals supervise`` restarts a job that crashes or
  hangs. It never imports the collector.
- ``protocol`` holds the contracts between the agent and what runs beside it (environment
  names, heartbeat files, directive codes, the token, exit codes), ``settings`` how flags and
  ``TORCHVITALS_*`` variables reach a config, ``errors`` the base exception.

The names below load on first use, so the collector, the supervisor and the offline readers
(``torchvitals diagnose``/``report``) start without importing torch. So do the errors a caller
catches (``except torchvitals.CheckpointError``: the name is looked up only when something is
raised) and ``__version__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ConfigError as ConfigError
from .errors import TorchvitalsError as TorchvitalsError
from .lazy import lazy_exports

_EXPORTS = {
    "Agent": ".agent.agent",
    "watch": ".agent.agent",
    "Config": ".agent.config",
    "Report": ".agent.report",
    "Action": ".records.vocabulary",
    "Rollback": ".agent.report",
    "record_attention": ".agent.measure.attention",
    "Thresholds": ".agent.detect.thresholds",
    "Verdict": ".agent.detect.verdict",
    "TrainingAborted": ".agent.recover.watchdog",
    "LightningCallback": ".agent.integrations.lightning",
    "TransformersCallback": ".agent.integrations.transformers",
    "watch_torchtitan": ".agent.integrations.torchtitan",
    # The extension points: a user's own signals, rules and sinks (watch(signals=, rules=,
    # sinks=)), and what they are written against.
    "Signal": ".agent.seams",
    "StepContext": ".agent.seams",
    "Packer": ".agent.seams",
    "Reduced": ".agent.seams",
    "Slot": ".agent.seams",
    "Observed": ".agent.seams",
    "Rule": ".agent.seams",
    "Sink": ".agent.seams",
    "SignalRegistry": ".agent.seams",
    "INFO": ".agent.seams",
    "WARNING": ".agent.seams",
    "CRITICAL": ".agent.seams",
    # The errors the README tells a caller to catch, from the module that raises each.
    "CheckpointError": ".agent.recover.agreement",
    "ResumeRefused": ".agent.recover.resume_policy",
    "LedgerError": ".records.ledger",
    "DoubleStepError": ".agent.guard",
    "GuardBypassedError": ".agent.guard",
    "MetricsPortError": ".agent.outputs.exporter",
    # Replaying a past run's log through the detector (``torchvitals backtest``), torch-free.
    "backtest": ".agent.tools.backtest.replay",
    "LogError": ".agent.tools.backtest.logs",
}
__all__ = sorted([*_EXPORTS, "ConfigError", "TorchvitalsError"])

if TYPE_CHECKING:
    # `X as X`: re-exported for a type checker reading this py.typed package (PEP 484).
    from .agent.agent import Agent as Agent
    from .agent.agent import watch as watch
    from .agent.config import Config as Config
    from .agent.detect.thresholds import Thresholds as Thresholds
    from .agent.detect.verdict import Verdict as Verdict
    from .agent.guard import DoubleStepError as DoubleStepError
    from .agent.guard import GuardBypassedError as GuardBypassedError
    from .agent.integrations.lightning import LightningCallback as LightningCallback
    from .agent.integrations.torchtitan import watch_torchtitan as watch_torchtitan
    from .agent.integrations.transformers import TransformersCallback as TransformersCallback
    from .agent.measure.attention import record_attention as record_attention
    from .agent.outputs.exporter import MetricsPortError as MetricsPortError
    from .agent.recover.agreement import CheckpointError as CheckpointError
    from .agent.recover.resume_policy import ResumeRefused as ResumeRefused
    from .agent.recover.watchdog import TrainingAborted as TrainingAborted
    from .agent.report import Report as Report
    from .agent.report import Rollback as Rollback
    from .agent.seams import CRITICAL as CRITICAL
    from .agent.seams import INFO as INFO
    from .agent.seams import WARNING as WARNING
    from .agent.seams import Observed as Observed
    from .agent.seams import Packer as Packer
    from .agent.seams import Reduced as Reduced
    from .agent.seams import Rule as Rule
    from .agent.seams import Signal as Signal
    from .agent.seams import SignalRegistry as SignalRegistry
    from .agent.seams import Sink as Sink
    from .agent.seams import Slot as Slot
    from .agent.seams import StepContext as StepContext
    from .agent.tools.backtest.logs import LogError as LogError
    from .agent.tools.backtest.replay import backtest as backtest
    from .records.ledger import LedgerError as LedgerError
    from .records.vocabulary import Action as Action

    __version__: str

_exported, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


def __getattr__(name: str) -> Any:
    if name == "__version__":
        # Read once from the installed metadata, pyproject.toml's version: the one source.
        # Lazily, since the lookup scans every distribution on sys.path (~0.1 s on a full one).
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version(__name__)
        except PackageNotFoundError:  # imported from a checkout that was never installed
            found = "0+unknown"
        globals()["__version__"] = found
        return found
    return _exported(name)
