"""The agent's configuration: one keyword-only dataclass, also settable from the environment.

Precedence: an argument to ``torchvitals.watch(...)`` > a ``TORCHVITALS_<FIELD>`` environment
variable (e.g. ``TORCHVITALS_SAMPLE_EVERY=20``, ``TORCHVITALS_METRICS_PORT=0``) > the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..protocol import ABORT_EXIT_CODE, ENV_PREFIX
from ..settings import settings
from .detect.thresholds import Thresholds


@dataclass(kw_only=True)
class Config:
    blocks: Mapping[str, Any] | list[str] | None = None
    """Blocks named by module path: a list of paths, or a mapping name -> path (or list of
    paths). Parameters under no named path form the block "other". None discovers blocks
    automatically (the repeated layers, the embeddings, the head, "other")."""

    sample_every: int = 10
    """Measure activation statistics and the update ratio on step 1 and every this many steps
    (10 keeps the agent under 2% of a step; see benchmarks/overhead.py)."""

    activations: bool = True
    """Record per-block activation statistics on sampled steps (forward hooks)."""

    update_ratio: bool = True
    """Record the per-block update ratio ||dw||/||w|| on sampled steps (a snapshot of the
    parameters is kept across the optimizer step of a sampled step only)."""

    update_ratio_max_bytes: int = 1 << 30
    """Bound on the parameter snapshot the update ratio keeps per rank during a sampled step.
    When the blocks do not fit, the sampled steps take turns over the blocks."""

    saturation_level: float = 0.99
    """An activation with |x| >= this counts as saturated (tanh/sigmoid units pinned at 1)."""

    split_ddp_work: bool = True
    """Under DDP (gradients identical on every rank) rank r measures every world-th block and
    the SUM reduction reassembles them. False makes every rank measure every block, which
    also catches a gradient corrupted on one rank after DDP's all-reduce."""

    clip_grad_norm: float | None = None
    """Clip the global gradient norm to this value before the optimizer step, reusing the
    measured norms (no second pass). The report keeps the norms from before clipping."""

    detect: Mapping[str, Any] | None = None
    """Overrides of the detection thresholds by name (see ``torchvitals.Thresholds``),
    e.g. ``{"loss_spike_mads": 8}``; from the environment as JSON."""

    skip_nonfinite: bool = True
    """Skip the optimizer (and scheduler) step on every rank when any rank's loss or gradient
    is NaN or Inf."""

    checkpoint_dir: str | None = None
    """Folder of the watchdog's healthy checkpoints and ledger; None turns the watchdog off. A
    run started again with the same folder resumes from its last healthy checkpoint."""

    checkpoint_every: int = 50
    """Save a healthy checkpoint after every this many steps (when the step is healthy)."""

    resume: str = "restart"
    """What a ``checkpoint_dir`` that already holds checkpoints means at start: "restart"
    continues it only in a restarted process (``torchvitals supervise``'s later attempts,
    torchrun's ``--max-restarts``) and refuses it otherwise; "auto" always continues it;
    "never" always refuses it. A refused folder is an error, never silently another run's."""

    checkpoint_keep: int = 3
    """Healthy checkpoints kept on disk."""

    snapshot_max_bytes: int = 32 << 30
    """Host memory per rank for two staged copies of its state: the last healthy one, which
    rollbacks restore from RAM, and the one written in the background (its buffers reused by
    the next save). When twice the largest rank's state exceeds it, checkpoints are saved
    synchronously and rollbacks read the disk (logged once); 0 always does so."""

    healthy_window: int = 20
    """A step is healthy when no warning or critical verdict came in this many steps before it."""

    lr_backoff: float = 0.5
    """Each rollback multiplies the learning rate by this, applied at every optimizer step over
    whatever set the LR (a scheduler, a framework, the loop), and kept across restarts."""

    skip_margin: int = 2
    """Batches skipped past the one that broke the run, on top of those since the checkpoint."""

    max_rollbacks: int = 3
    """More rollbacks than this within ``rollback_window`` steps aborts the run."""

    rollback_window: int = 500
    """Steps over which ``max_rollbacks`` is counted."""

    abort_exit_code: int = ABORT_EXIT_CODE
    """Exit code of ``TrainingAborted`` when the loop guard gives up (EX_TEMPFAIL)."""

    collector_url: str | None = None
    """Base URL of the collector whose directives (rollback, abort) this job obeys; global rank
    0 polls it off the training thread. The bearer token comes from TORCHVITALS_WEBHOOK_TOKEN."""

    collector_job: str = "default"
    """The job name the collector addresses directives to (its alerts' ``job`` label)."""

    collector_poll_seconds: float = 2.0
    """Seconds between polls of the collector."""

    heartbeat_dir: str | None = None
    """Folder where each rank keeps a heartbeat file for ``torchvitals supervise`` (which sets
    TORCHVITALS_HEARTBEAT_DIR for the job); None writes none."""

    metrics_port: int = 9400
    """Base port of each rank's Prometheus /metrics endpoint; the rank serves on
    base + LOCAL_RANK. 0 turns the endpoint off."""

    metrics_host: str = "127.0.0.1"
    """Address the /metrics endpoint binds to. Use 0.0.0.0 to let a scraper on another host in."""

    log_dir: str = "torchvitals_runs"
    """Folder for the run's JSON-lines event log (written by global rank 0). Empty turns it off."""

    run_name: str | None = None
    """Name of the run's folder under log_dir; None uses the start time."""

    log_every: int = 1
    """Write one event-log line every this many steps (steps that skip are always written)."""

    live: bool = False
    """Global rank 0 shows a live view of the vital signs on stdout: a rich panel on a terminal,
    plain lines (one every ``sample_every`` steps, one per verdict or rollback) otherwise."""

    def __post_init__(self) -> None:
        if self.sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {self.sample_every}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not 0.0 < self.saturation_level:
            raise ValueError(f"saturation_level must be > 0, got {self.saturation_level}")
        if self.checkpoint_every < 1 or self.checkpoint_keep < 1 or self.healthy_window < 0:
            raise ValueError("checkpoint_every and checkpoint_keep must be >= 1, healthy_window >= 0")
        if self.resume not in ("restart", "auto", "never"):
            raise ValueError(f"resume must be 'restart', 'auto' or 'never', got {self.resume!r}")
        if not 0.0 < self.lr_backoff <= 1.0:
            raise ValueError(f"lr_backoff must be in (0, 1], got {self.lr_backoff}")
        if self.skip_margin < 0 or self.max_rollbacks < 0 or self.rollback_window < 1:
            raise ValueError("skip_margin and max_rollbacks must be >= 0, rollback_window >= 1")
        if not self.collector_poll_seconds > 0:
            raise ValueError(f"collector_poll_seconds must be > 0, got {self.collector_poll_seconds}")
        if self.update_ratio_max_bytes < 0 or self.snapshot_max_bytes < 0:
            raise ValueError("update_ratio_max_bytes and snapshot_max_bytes must be >= 0")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None, got {self.clip_grad_norm}")
        Thresholds.from_overrides(self.detect)   # an unknown threshold fails at watch(), not later

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Build a Config from defaults, then ``TORCHVITALS_*`` variables, then ``overrides``.

        Args:
            environ: the environment to read (default ``os.environ``).
            **overrides: field values given in code; they win over the environment.

        Returns:
            The validated Config.
        """
        return cls(**settings(cls, environ, overrides, lambda name: ENV_PREFIX + name.upper(),
                              "torchvitals"))

