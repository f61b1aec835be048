"""The watchdog: healthy checkpoints, rollback with LR back-off and skipped batches, loop guard.

    agent = torchvitals.watch(model, optimizer, scheduler, checkpoint_dir="ckpt")

Every decision here is a function of the reduced report, so every rank takes it in the same
step. A step is *healthy* when its optimizer step ran, no warning or critical verdict about the
model (process warnings, such as a straggler, do not count) came in the ``healthy_window`` steps
before it and none is still active; every ``checkpoint_every``
steps a healthy step is saved. On a critical verdict every rank restores the last healthy
checkpoint and multiplies ``lr_scale`` by ``lr_backoff`` (the guarded optimizer applies it at
each step, over whatever set the LR), and the batches that led there are not trained on again.
More than ``max_rollbacks`` rollbacks within ``rollback_window`` steps aborts with
``abort_exit_code`` instead of looping. Each rollback, the abort and a resume print one line on
global rank 0.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...errors import TorchvitalsError
from ...protocol import ATTEMPT_ENV, CHECKPOINT, LEDGER_FILE, REFUSED, TRAIN
from ..config import Config
from ..detect.verdict import CRITICAL, PROCESS_PATTERNS, WARNING, Verdict
from ..report import Report, json_safe
from .async_save import CLOSE_TIMEOUT_S, Outcome, checkpoint_group
from .batches import SkipAwareBatches
from .checkpoint import CheckpointError, CheckpointStore
from .jobid import job_identity, resume_decision
from .ledger import Ledger
from .staged import StagedSaves
from .rng import reseed

log = logging.getLogger(__name__)


def _unhealthy(v: Verdict) -> bool:
    return v.severity in (WARNING, CRITICAL) and v.pattern not in PROCESS_PATTERNS


class ResumeRefused(TorchvitalsError, RuntimeError):
    """The checkpoint folder holds a run that this process was not told to continue."""


def restarted(environ: Any = None) -> bool:
    """Whether this process is a restart: by ``torchvitals supervise`` (attempt > 1) or by
    torchrun's ``--max-restarts`` (``TORCHELASTIC_RESTART_COUNT`` > 0)."""
    environ = os.environ if environ is None else environ
    try:
        return (int(environ.get(ATTEMPT_ENV, "1")) > 1
                or int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)
    except ValueError:
        return False


class TrainingAborted(SystemExit, TorchvitalsError):
    """The job gave up on purpose (the loop guard, or a collector's abort order); ``code`` is the
    exit code. A SystemExit, so an uncaught abort ends the process with that code; the agent
    refuses every later step, so a loop that swallows it cannot train on."""


class Watchdog:
    """Checkpoint store, ledger, LR scale and the rollback decisions of one rank."""

    def __init__(self, config: Config, group: Any = None):
        self.config = config
        self._own_group = None
        if config.snapshot_max_bytes:   # the background writes get their own group
            group = self._own_group = checkpoint_group(group)
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
        """At start: continue the run the folder holds, as ``Config.resume`` allows.

        Raises:
            ResumeRefused: the folder holds checkpoints and ``resume`` says not to continue them,
                or (unless ``resume="auto"``) its ledger names another job; the heartbeat says
                "refused" first, so the supervisor never retries it.
        """
        # Job identity (jobid.py): the job that wrote the folder continues it after any restart.
        job, previous = job_identity(), self.ledger.job_id
        self.ledger.job_id = job or previous
        latest = self.store.latest()
        if latest is None:
            return None
        mode = self.config.resume
        decision = resume_decision(previous, job, folder=f"checkpoint_dir {self.config.checkpoint_dir}")
        if decision.refuse and mode != "auto":
            self.on_phase(REFUSED)
            raise ResumeRefused(decision.message)
        if mode == "never" or (mode == "restart" and not (decision.same_job or restarted())):
            self.on_phase(REFUSED)
            raise ResumeRefused(
                f"checkpoint_dir {self.config.checkpoint_dir} already holds a run (latest "
                f"{latest.name}, learning-rate scale {self.ledger.lr_scale:g}, "
                f"{sum(e['event'] == 'rollback' for e in self.ledger.entries)} rollbacks in "
                f"{self.ledger.path}). A new run would silently continue it: pass "
                f"resume=\"auto\" (or TORCHVITALS_RESUME=auto) to continue it, or use a new "
                f"checkpoint_dir. (resume={mode!r}; torchvitals supervise and torchrun restarts "
                f"continue it by themselves)")
        restored = self.store.load(model, optimizer, scheduler)
        if scheduler is not None and restored["extra"].get("scheduler_step_due"):
            # Saved inside the framework's optimizer.step(), before the framework stepped the
            # scheduler for that step: take that step now, or the whole rest of the schedule
            # would run one step behind. (An in-process rollback restores the same state and
            # the framework's own scheduler.step() follows at once.)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step\\(\\)")
                scheduler.step()
        self.data.resume_at = restored["extra"].get("position", 0)
        self.data.restore_rank_state(restored["rank_state"])
        self.last_healthy = restored["step"]
        self.say("torchvitals: resumed from %s: step %d, learning-rate scale %g, %d batches "
                 "skipped (ledger %s)", restored["path"], restored["step"], self.lr_scale,
                 self.ledger.skipped.batches(), self.ledger.path)
        return restored["step"]

    def note(self, step: int, verdicts: list[Verdict]) -> None:
        if any(_unhealthy(v) for v in verdicts):
            self.last_bad = step

    def healthy(self, step: int, detector: Any) -> bool:
        """No warning or critical verdict in the last ``healthy_window`` steps, and none still
        active: a hot learning rate that keeps holding makes no step healthy. Wiring facts (a
        block frozen on purpose) do not count: they hold for the whole run; nor do the process
        warnings (straggler, memory growth, data stall): they say nothing of the weights."""
        if step - self.last_bad <= self.config.healthy_window:
            return False
        return not any(_unhealthy(v) for key, v in detector.active.items()
                       if key not in detector.pinned)

    def maybe_save(self, step: int, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                   detector: Any, scheduler_step_due: bool = False) -> bool:
        """Save a healthy checkpoint if one is due; collective when it is (identical on all ranks).

        ``scheduler_step_due``: the caller (a framework) steps the scheduler for this step after
        the save; a restart from it then takes that step (see ``resume``).
        """
        if step % self.config.checkpoint_every or not self.healthy(step, detector):
            return False
        extra = {"position": self.data.position, "lr_scale": self.lr_scale,
                 "verdicts": [v.to_dict() for v in detector.history[-100:]],
                 "scheduler_step_due": bool(scheduler_step_due and scheduler is not None)}
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
        try:
            if self.staged is None or not self.staged.in_flight:
                return
            outcome = self._settled(self.staged.wait(CLOSE_TIMEOUT_S))
            if outcome is None:
                log.error("torchvitals: a checkpoint write still in flight after %.0f s at exit; "
                          "left uncommitted", CLOSE_TIMEOUT_S)
            elif not outcome.ok:
                raise CheckpointError(f"the checkpoint of step {outcome.snapshot.step}, written "
                                      f"at exit, failed: {outcome.error}")
        finally:
            # Our own gloo group goes with us, unless a write still uses it: left for the
            # interpreter's teardown, gloo's threads can abort the process after a peer left.
            if self._own_group is not None and not (self.staged and self.staged.in_flight):
                dist.destroy_process_group(self._own_group)
                self._own_group = None

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

        The back-off is ``lr_scale``, which the guarded optimizer applies at each step. Batches
        drawn through ``agent.batches`` from the checkpoint's position to now (plus a margin) are
        never trained on again; a loop that draws its own batches gets its RNGs re-seeded, so the
        random draws that led here are not replayed either.

        Returns:
            ``{"to_step", "lr_scale", "skipped"}`` (``skipped`` None: the RNGs were re-seeded
            instead), or None when there is no checkpoint.

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
            self.say("torchvitals: ABORTING at step %d: %s. Rolling back again would not cure "
                     "it; a person must look (ledger %s). Exit code %d.", step, why,
                     self.ledger.path, self.config.abort_exit_code, error=True)
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
        self.lr_scale *= self.config.lr_backoff
        skipped: tuple[int, int] | None = None
        if self.data.used:
            skipped = (restored["extra"].get("position", 0), self.data.position + self.config.skip_margin)
        else:
            reseed(self.rollbacks + 1)
        self.ledger.record_rollback(step, to_step=restored["step"], reason=reason,
                                    lr_scale=self.lr_scale, skipped=skipped)
        self.rollbacks += 1
        self._rollback_ticks.append(tick)
        self.last_bad = restored["step"]
        what = (f"batches {skipped[0]}..{skipped[1] - 1} skipped" if skipped else
                "the loop's RNGs re-seeded so its random batches are not replayed")
        self.say("torchvitals: ROLLBACK at step %d (%s): back to step %d, learning-rate scale "
                 "%g, %s; rollback %d of at most %d within %d steps (ledger %s)", step, reason,
                 restored["step"], self.lr_scale, what, len(recent) + 1,
                 self.config.max_rollbacks, self.config.rollback_window, self.ledger.path)
        return {"to_step": restored["step"], "lr_scale": self.lr_scale,
                "skipped": list(skipped) if skipped else None}

    def say(self, message: str, *args: Any, error: bool = False) -> None:
        """One line for a person, on global rank 0 (every rank takes the same decision)."""
        if self.ledger.writer:
            (log.error if error else log.warning)(message, *args)

    def metrics(self) -> dict[str, float]:
        return {"rollbacks": self.rollbacks, "lr_scale": self.lr_scale,
                "last_healthy_step": float("nan") if self.last_healthy is None else self.last_healthy,
                "skipped_batches": self.ledger.skipped.batches(),
                "checkpoint_seconds": self.checkpoint_seconds,
                "checkpoint_stall_seconds": self.stall_seconds,
                "checkpoint_failures": self.failed_saves}

