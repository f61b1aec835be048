"""The watchdog: healthy checkpoints, rollback with LR back-off and skipped batches, loop guard.

    agent = torchvitals.watch(model, optimizer, scheduler, checkpoint_dir="ckpt")

Every decision here is a function of the reduced report, so every rank takes it in the same
step. A step is *healthy* when its optimizer step ran and no warning or critical verdict came in
the ``healthy_window`` steps before it; every ``checkpoint_every`` steps a healthy step is saved.
On a critical verdict every rank restores the last healthy checkpoint, multiplies the learning
rate by ``lr_backoff``, and skips the batches from the checkpoint's position to the current one
plus ``skip_margin``. More than ``max_rollbacks`` rollbacks within ``rollback_window`` steps
aborts with ``abort_exit_code`` instead of looping.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...errors import TorchvitalsError
from ...protocol import CHECKPOINT, LEDGER_FILE, TRAIN
from ..config import Config
from ..detect.verdict import CRITICAL, WARNING, Verdict
from ..report import Report, json_safe
from .async_save import CLOSE_TIMEOUT_S, Outcome, checkpoint_group
from .batches import SkipAwareBatches
from .checkpoint import CheckpointError, CheckpointStore
from .ledger import Ledger
from .staged import StagedSaves

log = logging.getLogger(__name__)


class TrainingAborted(SystemExit, TorchvitalsError):
    """The job gave up on purpose (the loop guard, or a collector's abort order); ``code`` is the
    exit code. A SystemExit, so an uncaught abort ends the process with that code; the agent
    refuses every later step, so a loop that swallows it cannot train on."""


class Watchdog:
    """Checkpoint store, ledger, LR scale and the rollback decisions of one rank."""

    def __init__(self, config: Config, group: Any = None):
        self.config = config
        if config.snapshot_max_bytes:   # the background writes get their own group
            group = checkpoint_group(group)
        self.store = CheckpointStore(config.checkpoint_dir, keep=config.checkpoint_keep, group=group)
        self.staged = StagedSaves(self.store, config.snapshot_max_bytes) if config.snapshot_max_bytes else None
        self.failed_saves = 0
        self.stall_seconds = float("nan")
        """How long the last healthy save stalled training (staging, or the whole sync save)."""
        self._unreported: Outcome | None = None
        rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.ledger = Ledger(os.path.join(config.checkpoint_dir, LEDGER_FILE), writer=rank0).load()
        self.lr_scale = self.ledger.lr_scale
        self.data = SkipAwareBatches(skipped=self.ledger.skipped)
        self.last_bad = -(10 ** 9)
        self.last_healthy: int | None = None
        self.rollbacks = 0
        self._rollback_ticks: list[int] = []
        self.checkpoint_seconds = float("nan")
        self.on_phase: Callable[[str], None] = lambda phase: None
        """Told CHECKPOINT before a checkpoint is written or loaded and TRAIN after."""

    def resume(self, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> int | None:
        """After a restart: load the last healthy checkpoint and the ledger's state, if any."""
        if self.store.latest() is None:
            return None
        restored = self.store.load(model, optimizer, scheduler)
        self._apply_lr_scale(optimizer, scheduler, restored["extra"].get("lr_scale", 1.0))
        self.data.resume_at = restored["extra"].get("position", 0)
        self.data.restore_rank_state(restored["rank_state"])
        self.last_healthy = restored["step"]
        log.warning("torchvitals: resumed from %s (step %d, lr scale %g, %d batches skipped)",
                    restored["path"], restored["step"], self.lr_scale, self.ledger.skipped.batches())
        return restored["step"]

    def note(self, step: int, verdicts: list[Verdict]) -> None:
        if any(v.severity in (WARNING, CRITICAL) for v in verdicts):
            self.last_bad = step

    def healthy(self, step: int) -> bool:
        return step - self.last_bad > self.config.healthy_window

    def maybe_save(self, step: int, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                   history: list[Verdict]) -> bool:
        """Save a healthy checkpoint if one is due; collective when it is (identical on all ranks)."""
        if step % self.config.checkpoint_every or not self.healthy(step):
            return False
        extra = {"position": self.data.position, "lr_scale": self.lr_scale,
                 "verdicts": [v.to_dict() for v in history[-100:]]}
        if self.staged is not None and self.staged.fits(model, optimizer):
            self.on_phase(CHECKPOINT)       # the stall is short, unless the last write lags
            try:
                self._settled(self.staged.begin(step, model, optimizer, scheduler,
                                                json_safe(extra), self.data.rank_state()))
            finally:
                self.on_phase(TRAIN)
            self.stall_seconds = self.staged.stall_seconds
            return True
        self.on_phase(CHECKPOINT)
        try:
            path = self.store.save(step, model, optimizer, scheduler, extra=json_safe(extra),
                                   rank_state=self.data.rank_state())
        finally:
            self.on_phase(TRAIN)
        self.checkpoint_seconds = self.stall_seconds = self.store.last_save_seconds
        self.ledger.record_checkpoint(step, str(path))
        self.last_healthy = step
        return True

    def save_flags(self) -> list[float]:
        """``[done, failed]`` of this rank's background write, for the step's SUM reduction."""
        return self.staged.flags() if self.staged is not None else [0.0, 0.0]

    def settle(self, reduced: list[float], world_size: int, report: Report) -> None:
        """Every rank, same step: commit (ledger, rollback target) or report a background save
        once the reduced flags say every rank's write ended; noted in ``report``."""
        if self.staged is None:
            return
        self._settled(self.staged.settle(reduced, world_size))
        # Also one that a due save or a rollback had to wait for at an earlier step.
        outcome, self._unreported = self._unreported, None
        if outcome is not None and outcome.ok:
            report.checkpoint_committed = outcome.snapshot.step
        elif outcome is not None:
            report.checkpoint_failed = f"step {outcome.snapshot.step}: {outcome.error}"

    def close(self) -> None:
        """Let a background write in flight finish (or give up after CLOSE_TIMEOUT_S: its
        folder then stays an uncommitted ``.tmp-*``, never loaded).

        Raises:
            CheckpointError: that write failed (on this rank or another): the job's last healthy
                state is not the one it ended with, which its exit status should say.
        """
        if self.staged is None or not self.staged.in_flight:
            return
        outcome = self._settled(self.staged.wait(CLOSE_TIMEOUT_S))
        if outcome is None:
            log.error("torchvitals: a checkpoint write still in flight after %.0f s at exit; "
                      "left uncommitted", CLOSE_TIMEOUT_S)
        elif not outcome.ok:
            raise CheckpointError(f"the checkpoint of step {outcome.snapshot.step}, written at "
                                  f"exit, failed: {outcome.error}")

    def _settled(self, outcome: Outcome | None) -> Outcome | None:
        if outcome is None:
            return None
        self._unreported = outcome
        step = outcome.snapshot.step
        if outcome.ok:
            self.checkpoint_seconds = outcome.write_seconds
            self.ledger.record_checkpoint(step, outcome.path)
            self.last_healthy = step
        else:
            self.failed_saves += 1
            log.error("torchvitals: the healthy checkpoint of step %d failed on some rank and was "
                      "not committed: %s; the rollback target stays step %s", step, outcome.error,
                      self.last_healthy)
        return outcome

    def rollback(self, step: int, tick: int, reason: str, model: torch.nn.Module, optimizer: Any,
                 scheduler: Any) -> dict[str, Any] | None:
        """Restore the last healthy checkpoint with the LR backed off and the bad batches skipped.

        Returns:
            ``{"to_step", "lr_scale", "skipped"}``, or None when there is no checkpoint yet.

        Raises:
            TrainingAborted: the loop guard tripped (after the ledger recorded the abort).
        """
        if self.staged is not None and self.staged.in_flight:
            self.on_phase(CHECKPOINT)
            try:
                self._settled(self.staged.wait())   # every rank at this step: the same target
            finally:
                self.on_phase(TRAIN)
        if self.store.latest() is None:
            return None
        recent = [t for t in self._rollback_ticks if tick - t < self.config.rollback_window]
        if len(recent) >= self.config.max_rollbacks:
            why = (f"{len(recent) + 1} rollbacks within {self.config.rollback_window} steps "
                   f"(max_rollbacks={self.config.max_rollbacks}); last: {reason}")
            self.ledger.record_abort(step, why)
            raise TrainingAborted(self.config.abort_exit_code)
        restored = None
        if self.staged is not None and self.last_healthy is not None:
            restored = self.staged.restore(self.last_healthy, model, optimizer, scheduler)
        if restored is None:
            self.on_phase(CHECKPOINT)
            try:
                restored = self.store.load(model, optimizer, scheduler)
            finally:
                self.on_phase(TRAIN)
        scale = self.lr_scale * self.config.lr_backoff
        self._apply_lr_scale(optimizer, scheduler, restored["extra"].get("lr_scale", 1.0), scale)
        start = restored["extra"].get("position", 0)
        stop = self.data.position + self.config.skip_margin
        self.ledger.record_rollback(step, to_step=restored["step"], reason=reason,
                                    lr_scale=self.lr_scale, skipped=(start, stop))
        self.rollbacks += 1
        self._rollback_ticks.append(tick)
        self.last_bad = restored["step"]
        return {"to_step": restored["step"], "lr_scale": self.lr_scale, "skipped": [start, stop]}

    def _apply_lr_scale(self, optimizer: Any, scheduler: Any, saved_scale: float,
                        scale: float | None = None) -> None:
        """Bring the just-restored LRs (at ``saved_scale``) to ``scale`` (default: the ledger's).

        The scheduler's ``base_lrs`` and each group's ``initial_lr`` scale too, so the back-off
        survives every later scheduler step (LambdaLR & co. recompute the LR from them).
        """
        if scale is not None:
            self.lr_scale = scale
        factor = self.lr_scale / saved_scale
        if factor == 1.0:
            return
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * factor
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

    def metrics(self) -> dict[str, float]:
        return {"rollbacks": self.rollbacks, "lr_scale": self.lr_scale,
                "last_healthy_step": float("nan") if self.last_healthy is None else self.last_healthy,
                "skipped_batches": self.ledger.skipped.batches(),
                "checkpoint_seconds": self.checkpoint_seconds,
                "checkpoint_stall_seconds": self.stall_seconds,
                "checkpoint_failures": self.failed_saves}

