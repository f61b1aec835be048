"""The watchdog: healthy checkpoints, rollback with LR back-off and skipped batches, loop guard.

    agent = torchvitals.watch(model, optimizer, scheduler, checkpoint_dir="ckpt")
    watchdog = Watchdog.open(config, group)     # what the agent does: group made, ledger read

``Watchdog`` is the facade the step calls; each concept is its own piece, passed in: when a
step is healthy and a save due (``save_policy``), how it is written (``saver``: synchronous or
staged in the background), how far a rollback goes and when it is a loop (``rollback_policy``),
whether a folder that holds a run is continued (``resume_policy``), and the durable record
(``ledger``). ``Watchdog.open`` builds them from a Config; that is where the checkpoint group
is made (``groups``) and the ledger read, never in a constructor.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ...errors import TorchvitalsError
from ...protocol import CHECKPOINT, LEDGER_FILE, REFUSED, TRAIN
from ...records.jobid import job_identity, resume_decision
from ...records.ledger import Ledger
from ..config import Config, RecoverConfig
from ..detect.verdict import Verdict
from ..jsonsafe import json_safe
from ..measure.fingerprint import state_fingerprint
from ..report import Report, Rollback
from .agreement import failures
from .async_save import Outcome
from .batches import SkipAwareBatches
from .checkpoint import CheckpointError, CheckpointStore
from .groups import checkpoint_group
from .resume_policy import ResumePolicy, ResumeRefused, restarted
from .rng import reseed
from .rollback_policy import RollbackPolicy
from .save_policy import SavePolicy, unhealthy
from .saver import Saver, SyncSaver
from .snapshot import Restored
from .staged import StagedSaves
from .targets import Targets
from .trust import CheckpointKey

__all__ = ["ResumeRefused", "Rollback", "TrainingAborted", "Watchdog", "restarted"]

READ_KEY = "read"
"""``Watchdog.open(key=READ_KEY)``: read global rank 0's checkpoint key there."""

log = logging.getLogger(__name__)


class TrainingAborted(SystemExit, TorchvitalsError):
    """The job gave up on purpose (the loop guard, or a collector's abort order); ``code`` is the
    exit code. A SystemExit, so an uncaught abort ends the process with that code; the agent
    refuses every later step, so a loop that swallows it cannot train on.

    Args:
        code: the exit code.
        why: why it gave up, for the records (the loop guard's count, no trusted checkpoint
            left, the collector's order).
    """

    def __init__(self, code: int, why: str = "") -> None:
        super().__init__(code)
        self.why = why


class Watchdog:
    """Checkpoint store, ledger, LR scale and the rollback decisions of one rank.

    Args:
        store: the checkpoint folder.
        saver: writes the healthy checkpoints (over ``store``).
        ledger: the job's record, loaded (``Ledger.load``).
        save_policy: when a step is healthy and a save due.
        rollback_policy: back-off, skipped range, loop guard; its ``lr_scale`` is the ledger's.
        resume_policy: whether a folder that holds a run is continued.
        abort_exit_code: the exit code of the loop guard's abort.
        close_timeout_s: how long ``close`` waits for a background write in flight.
        data: the batch iterator whose skip list is the ledger's (default: a new one).
        targets: which checkpoints a rollback may go back to (default: every one the ledger
            committed and did not distrust, with the default ``trust_steps`` and
            ``verify_steps``).
        lr_ramp_steps: steps over which the back-off returns to 1 once a rollback cured the
            run (0: never).
    """

    def __init__(
        self,
        *,
        store: CheckpointStore,
        saver: Saver,
        ledger: Ledger,
        save_policy: SavePolicy,
        rollback_policy: RollbackPolicy,
        resume_policy: ResumePolicy,
        abort_exit_code: int,
        close_timeout_s: float,
        data: SkipAwareBatches | None = None,
        targets: Targets | None = None,
        lr_ramp_steps: int = 0,
    ) -> None:
        self.store = store
        self.lr_ramp_steps = lr_ramp_steps
        self._ramp: tuple[int, float] | None = None
        """``(step it started, the scale it started from)`` of the ramp back to 1, if any."""
        self.saver = saver
        self.ledger = ledger
        self.save_policy = save_policy
        self.rollback_policy = rollback_policy
        self.resume_policy = resume_policy
        self.abort_exit_code = abort_exit_code
        self.close_timeout_s = close_timeout_s
        self.data = data if data is not None else SkipAwareBatches(skipped=ledger.skipped)
        self.targets = (
            targets
            if targets is not None
            else _targets(ledger, RecoverConfig.trust_steps, RecoverConfig.verify_steps, store.keep)
        )
        self.last_healthy: int | None = None
        self.failed_saves = 0
        self.checkpoint_seconds = float("nan")
        self.stall_seconds = float("nan")
        """How long the last healthy save stalled training (staging, or the whole sync save)."""
        self._unreported: Outcome | None = None
        self._fingerprints: dict[int, int] = {}
        """Step -> this rank's ``state_fingerprint`` of the parameters it saved, for the
        checkpoints that may still be restored: a restore must bring back the same."""
        self._compromised = False
        """A restore failed its fingerprint check: the model holds a state no step had."""
        self.on_phase: Callable[[str], None] = lambda phase: None
        """Told CHECKPOINT before a checkpoint is written or loaded and TRAIN after."""

    @classmethod
    def open(
        cls, config: Config, group: Any = None, *, key: CheckpointKey | str | None = READ_KEY
    ) -> Watchdog:
        """The watchdog ``config`` describes, over ``group``; collective: every rank, same call.

        Makes the background writes' group the first time a process needs one for these ranks
        (``groups.checkpoint_group``: made once, reused by every later agent), proves the folder
        is one that every rank shares (``CheckpointStore.probe``), and reads the ledger on
        global rank 0, whose text every rank then parses alike.

        Args:
            config: the settings (``checkpoint_dir`` and the watchdog's own).
            group: the agent's process group.
            key: global rank 0's checkpoint key, read beforehand by the caller (the agent reads
                it among each rank's own work, so a key missing on rank 0 alone fails every rank
                there); ``READ_KEY``: read it here.

        Raises:
            CheckpointError: the folder cannot be written, or is not the same folder on every
                rank (node-local disks), on every rank alike.
            LedgerError: the ledger file exists but cannot be trusted (on every rank alike).
            ValueError: ``config`` names no ``checkpoint_dir``.
        """
        directory = config.checkpoint_dir
        if directory is None:
            raise ValueError("Watchdog.open: the config names no checkpoint_dir to roll back from")
        if config.snapshot_max_bytes:  # the background writes get their own group
            group = checkpoint_group(group)
        rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        if key == READ_KEY:
            # Only global rank 0 writes and checks the manifests, so only it needs the key (and
            # a key file missing on another node cannot fail one rank alone).
            key = CheckpointKey.from_env(key_file=config.checkpoint_key_file) if rank0 else None
        store = CheckpointStore(
            directory,
            keep=config.checkpoint_keep,
            group=group,
            key=key if isinstance(key, CheckpointKey) else None,
            trust_unsigned=config.trust_unsigned_checkpoints,
        )
        store.probe()
        ledger = Ledger(os.path.join(directory, LEDGER_FILE), writer=rank0).parse(
            store.read_on_leader(LEDGER_FILE)
        )
        store.record_with(
            ledger.checkpoint_names,
            ledger.record_checkpoint if rank0 else None,
            ledger.distrusted,
        )
        saver = (
            StagedSaves(store, config.snapshot_max_bytes)
            if config.snapshot_max_bytes
            else SyncSaver(store)
        )
        return cls(
            store=store,
            saver=saver,
            ledger=ledger,
            save_policy=SavePolicy(
                checkpoint_every=config.checkpoint_every, healthy_window=config.healthy_window
            ),
            rollback_policy=RollbackPolicy(
                max_rollbacks=config.max_rollbacks,
                rollback_window=config.rollback_window,
                lr_backoff=config.lr_backoff,
                skip_margin=config.skip_margin,
                lr_scale=ledger.lr_scale,
            ),
            resume_policy=ResumePolicy(config.resume),
            abort_exit_code=config.abort_exit_code,
            close_timeout_s=config.checkpoint_close_timeout_s,
            targets=_targets(
                ledger, config.trust_steps, config.verify_steps, config.checkpoint_keep
            ),
            lr_ramp_steps=config.lr_ramp_steps,
        )

    @property
    def lr_scale(self) -> float:
        """What the rollbacks' back-off has left of the learning rate."""
        return self.rollback_policy.lr_scale

    @property
    def rollbacks(self) -> int:
        """Rollbacks taken by this process."""
        return self.rollback_policy.rollbacks

    @property
    def rollback_repeats(self) -> int:
        """Rollbacks taken by this process that repeated one that did not cure."""
        return self.rollback_policy.repeats

    @property
    def staged(self) -> StagedSaves | None:
        """The staged saver (its in-memory copy), or None when saves are synchronous."""
        return self.saver if isinstance(self.saver, StagedSaves) else None

    def resume(self, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> int | None:
        """At start: continue the run the folder holds, as ``Config.resume`` allows.

        Returns:
            The step resumed from, or None for an empty folder.

        Raises:
            ResumeRefused: the folder holds checkpoints and ``resume`` says not to continue them,
                or (unless ``resume="auto"``) its ledger names another job; the heartbeat says
                "refused" first, so the supervisor never retries it.
        """
        # Taken on global rank 0 (its folder listing, its job identity, its restart counters)
        # and told to every rank, so every rank continues or refuses alike.
        latest, job, refusal = self.store.on_leader(self._resume_decision)
        self.ledger.job_id = job
        if refusal is not None:
            self.on_phase(REFUSED)
            raise ResumeRefused(refusal)
        if latest is None:
            return None
        restored = self.store.load(model, optimizer, scheduler)
        if scheduler is not None and restored.extra.get("scheduler_step_due"):
            # Saved inside the framework's optimizer.step(), before the framework stepped the
            # scheduler for that step: take that step now, or the whole rest of the schedule
            # would run one step behind. (An in-process rollback restores the same state and
            # the framework's own scheduler.step() follows at once.)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step\\(\\)")
                scheduler.step()
        self.data.resume_at = restored.extra.get("position", 0)
        self.data.restore_rank_state(restored.rank_state)
        self.last_healthy = restored.step
        self.say(
            "torchvitals: resumed from %s: step %d, learning-rate scale %g, %d batches "
            "skipped (ledger %s)",
            restored.path,
            restored.step,
            self.lr_scale,
            self.ledger.skipped.batches(),
            self.ledger.path,
        )
        return restored.step

    def _resume_decision(self) -> tuple[str | None, str | None, str | None]:
        """``(latest checkpoint, the job id to record, why not to continue)`` from this rank's
        view (global rank 0's is every rank's: see ``resume``)."""
        # Job identity (jobid.py): the job that wrote the folder continues it after any restart.
        job, previous = job_identity(), self.ledger.job_id
        latest = self.store.latest()
        if latest is None:
            return None, job or previous, None
        decision = resume_decision(previous, job, folder=f"checkpoint_dir {self.store.root}")
        if decision.refuse and self.resume_policy.mode != "auto":
            return str(latest), job or previous, decision.message
        # The same job continues its folder after any kind of restart; anything else is the
        # resume mode's to decide.
        if not (decision.same_job and self.resume_policy.mode == "restart"):
            try:
                self.resume_policy.check(latest, self.ledger, self.store.root)
            except ResumeRefused as refused:
                return str(latest), job or previous, str(refused)
        return str(latest), job or previous, None

    def note(self, step: int, verdicts: list[Verdict]) -> None:
        """Take in the verdicts of ``step`` (every step, every rank): the save policy's window,
        and the checkpoints an unhealthy step distrusts (``targets``)."""
        self.save_policy.note(step, verdicts)
        bad = next((v.pattern for v in verdicts if unhealthy(v)), None)
        self._distrust(self.targets.note(step, bad))
        self._trust()
        self._ramp_lr(step)

    def _ramp_lr(self, step: int) -> None:
        """Bring the back-off linearly back to 1 over ``lr_ramp_steps`` once the last rollback
        cured the run (the same steps on every rank: the same scale)."""
        cured, self.targets.cured = self.targets.cured, None
        if not self.lr_ramp_steps:
            return
        if cured is not None and self.lr_scale < 1.0:
            self._ramp = (cured, self.lr_scale)
            self.say(
                "torchvitals: the rollback cured the run; the learning-rate scale returns "
                "from %g to 1 over %d steps (lr_ramp_steps)",
                self.lr_scale,
                self.lr_ramp_steps,
            )
        if self._ramp is None:
            return
        start, base = self._ramp
        done = min(1.0, max(0.0, (step - start) / self.lr_ramp_steps))
        self.rollback_policy.lr_scale = base + (1.0 - base) * done
        if done >= 1.0:
            self._ramp = None
            self.ledger.record_ramp(step, 1.0)
            self.say("torchvitals: the learning-rate scale is back to 1 at step %d", step)

    def healthy(self, step: int, detector: Any) -> bool:
        """``SavePolicy.healthy`` over the detector's active verdicts, wiring facts (pinned:
        they hold for the whole run) left out."""
        return self.save_policy.healthy(step, _active(detector))

    def maybe_save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        detector: Any,
        scheduler_step_due: bool = False,
    ) -> bool:
        """Save a healthy checkpoint if one is due; collective when it is (identical on all ranks).

        ``scheduler_step_due``: the caller (a framework) steps the scheduler for this step after
        the save; a restart from it then takes that step (see ``resume``).
        """
        if not self.save_policy.due(step, _active(detector)):
            return False
        extra = {
            "position": self.data.position,
            "lr_scale": self.lr_scale,
            "verdicts": [v.to_dict() for v in detector.history[-100:]],
            "scheduler_step_due": bool(scheduler_step_due and scheduler is not None),
        }
        self.targets.saved(step)
        self.on_phase(CHECKPOINT)  # a staged save's stall is short, unless the last write lags
        self._fingerprints[step] = state_fingerprint(model.parameters())
        try:
            saved = self.saver.save(
                step, model, optimizer, scheduler, json_safe(extra), self.data.rank_state()
            )
        finally:
            self.on_phase(TRAIN)
        self.stall_seconds = saved.stall_seconds
        self._settled(saved.earlier)
        if saved.committed is not None:  # synchronous: committed now, nothing to report later
            self._commit(saved.committed)
        return True

    def save_flags(self) -> list[float]:
        """``[done, failed]`` of this rank's background write, for the step's SUM reduction."""
        return self.saver.flags()

    def settle(self, reduced: list[float], world_size: int, report: Report) -> None:
        """Every rank, same step: commit (ledger, rollback target) or report a background save
        once the reduced flags say every rank's write ended; noted in ``report``."""
        self._settled(self.saver.settle(reduced, world_size))
        # Also one that a due save or a rollback had to wait for at an earlier step.
        outcome, self._unreported = self._unreported, None
        if outcome is not None and outcome.ok:
            report.checkpoint.committed = outcome.step
        elif outcome is not None:
            report.checkpoint.failed = f"step {outcome.step}: {outcome.error}"

    def close(self) -> None:
        """Let a background write in flight finish, waiting ``close_timeout_s`` at most.

        The wait joins this rank's write thread, never a collective, so a peer that died or
        stopped (a hung host) mid-save cannot hold it. A write still in flight after the wait,
        or ended by an error of its own collectives (a peer gone), is left uncommitted and
        logged: its step, its ``.tmp-*`` folder (never loaded) and the last committed
        checkpoint, which stays the rollback target. Its thread is a daemon, and ``groups``
        leaves its group alone at exit, so it holds neither this call nor the process's exit.
        The checkpoint group stays: the process's later agents reuse it (``groups``).

        Raises:
            CheckpointError: the write failed and every rank agreed it did (a full disk): the
                job's last healthy state is not the one it ended with, which its exit status
                should say. A peer that died or stopped is not raised here: that peer is the
                job's failure, and a second failing rank would blur who the culprit is.
        """
        step = self.saver.pending_step
        if step is None:
            return
        self.on_phase(CHECKPOINT)  # the supervisor's checkpoint clock, not the step's
        try:
            outcome = self.saver.wait(self.close_timeout_s)
        finally:
            self.on_phase(TRAIN)
        if outcome is None:
            why = (
                f"its write was still in flight after checkpoint_close_timeout_s="
                f"{self.close_timeout_s:g} s (a peer died or stopped mid-save)"
            )
        elif outcome.ok or outcome.agreed:
            self._settled(outcome)
            if not outcome.ok:
                raise CheckpointError(
                    f"the checkpoint of step {step}, written at exit, failed: {outcome.error}"
                )
            return
        else:
            self.failed_saves += 1
            why = f"its write lost a peer ({outcome.error})"
        log.error("torchvitals: %s", self._left_at_close(step, why))

    def _left_at_close(self, step: int, why: str) -> str:
        """What a save that ``close`` gave up on leaves: its folder and the rollback target,
        as the ledger (what a restart resumes from) records it."""
        tmp, final = self.store.folders(step)
        last = self.ledger.last_checkpoint
        if last is not None and last["step"] == step and last["path"] == str(final):
            # Global rank 0 commits alone once every rank's files are hashed: a peer lost after
            # that leaves a complete checkpoint, recorded and renamed into place.
            return (
                f"the checkpoint of step {step} was committed ({final}) but not every rank "
                f"confirmed it before close() ended: {why}; it is the rollback target"
            )
        target = (
            f"the last committed checkpoint, step {last['step']} ({last['path']}), stays the "
            f"rollback target"
            if last is not None
            else "no checkpoint was committed before it (a restart starts afresh)"
        )
        return (
            f"the checkpoint of step {step} was left uncommitted at close(): {why}; its "
            f"folder {tmp} is never loaded, and {target}"
        )

    def _settled(self, outcome: Outcome | None) -> Outcome | None:
        """A background save ended: commit it, and report it at the next ``settle``."""
        if outcome is None:
            return None
        self._unreported = outcome
        if outcome.ok:
            self._commit(outcome)
        else:
            self.failed_saves += 1
            self.targets.failed(outcome.step)
            log.error(
                "torchvitals: the healthy checkpoint of step %d failed on some rank and was "
                "not committed: %s; the rollback target stays step %s",
                outcome.step,
                outcome.error,
                self.targets.target(),
            )
        return outcome

    def _commit(self, outcome: Outcome) -> None:
        if outcome.path is None:  # a save that succeeded names its folder
            raise CheckpointError(f"the checkpoint of step {outcome.step} names no folder")
        self.checkpoint_seconds = outcome.write_seconds
        self.ledger.record_checkpoint(outcome.step, outcome.path)
        self.last_healthy = outcome.step
        self._distrust(self.targets.committed(outcome.step))
        self._trust()

    def _trust(self) -> None:
        """Record the committed checkpoints that earned trust: the clean steps after each,
        and the fingerprint of global rank 0's state in it."""
        for step, clean_through in self.targets.take_trusted():
            fingerprint = self._fingerprints.get(step)
            self.ledger.record_trust(
                step,
                self.store.folders(step)[1],
                clean_through=clean_through,
                fingerprint=None if fingerprint is None else f"{fingerprint:013x}",
            )
        candidates = self.targets.candidates()
        for step in [s for s in self._fingerprints if s not in candidates]:
            del self._fingerprints[step]  # pruned or distrusted: never restored again

    def _distrust(self, distrusted: dict[int, str]) -> None:
        """Record the committed checkpoints ``targets`` distrusted, and say so once."""
        for step, why in sorted(distrusted.items()):
            self.ledger.record_distrust(step, self.store.folders(step)[1], why)
            self.say("torchvitals: the checkpoint of step %d is never restored: %s", step, why)

    def rollback(
        self,
        step: int,
        tick: int,
        reason: str,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
    ) -> Rollback | None:
        """Restore the newest trusted checkpoint (``targets``) with the LR backed off and the
        bad batches skipped; a repeat of a rollback that did not cure goes further back, cuts
        deeper and skips wider.

        The back-off is ``lr_scale``, which the guarded optimizer applies at each step. Batches
        drawn through ``agent.batches`` from the checkpoint's position to now (plus a margin) are
        never trained on again; a loop that draws its own batches gets its RNGs re-seeded, so the
        random draws that led here are not replayed either.

        Returns:
            The Rollback (``skipped`` None: the RNGs were re-seeded instead), or None when there
            is no checkpoint.

        Raises:
            TrainingAborted: the loop guard tripped, or a repeat found no checkpoint left to go
                back to (after the ledger recorded the abort).
        """
        if self.saver.in_flight:
            self.on_phase(CHECKPOINT)
            try:
                self._settled(self.saver.wait())  # every rank at this step: the same target
            finally:
                self.on_phase(TRAIN)
        # Whether there is a checkpoint at all, as global rank 0 sees the folder (every rank
        # takes its answer: one rank's stale view of a shared folder must not split them).
        if self.store.on_leader(self.store.latest) is None:
            return None
        policy = self.rollback_policy
        why = policy.refusal(tick, reason)
        if why is not None:
            self._give_up(step, why)
        self._ramp = None  # a rollback during a ramp backs off from where the ramp got to
        repeat = self.targets.repeat(step)
        if repeat is not None:  # the last rollback did not cure: its checkpoint is not the cure
            self._distrust(self.targets.fail_verification(repeat, step, reason))
        restored = self._restore_target(model, optimizer, scheduler)
        if restored is None and repeat is not None:
            self._give_up(
                step,
                f"no trusted checkpoint is left to roll back to after the rollback at step "
                f"{repeat.of} did not cure the run ({reason} again); learning-rate scale "
                f"{self.lr_scale:g}",
            )
        if restored is None and self._compromised:
            self._give_up(
                step,
                f"no checkpoint is left whose state comes back as it was saved ({reason} at "
                f"step {step})",
            )
        if restored is None:  # every checkpoint so far was followed by trouble
            self.say(
                "torchvitals: no trusted checkpoint to roll back to at step %d (%s); the step "
                "is skipped instead",
                step,
                reason,
                error=True,
            )
            return None
        escalation = repeat.escalation if repeat is not None else 0
        rolled = policy.take(
            tick,
            to_step=restored.step,
            from_position=restored.extra.get("position", 0),
            position=self.data.position,
            replayable=self.data.used,
            escalation=escalation,
            repeat_of=repeat.of if repeat is not None else None,
        )
        if rolled.skipped is None:
            reseed(policy.rollbacks)
        self.ledger.record_rollback(
            step,
            to_step=rolled.to_step,
            reason=reason,
            lr_scale=rolled.lr_scale,
            skipped=rolled.skipped,
            positions=(
                (restored.extra.get("position", 0), self.data.position, policy.margin(escalation))
                if rolled.skipped
                else None
            ),
            repeat_of=rolled.repeat_of,
        )
        self._distrust(self.targets.rolled_back(step, rolled.to_step))
        self.last_healthy = rolled.to_step
        self.save_policy.restart_at(rolled.to_step)
        what = (
            f"batches {rolled.skipped[0]}..{rolled.skipped[1] - 1} skipped"
            if rolled.skipped
            else "the loop's RNGs re-seeded so its random batches are not replayed"
        )
        again = (
            f"; a repeat of the rollback at step {rolled.repeat_of}, which did not cure the "
            f"run: escalated {rolled.escalation}x (an earlier checkpoint, the learning rate cut "
            f"{rolled.escalation} more time(s), {policy.margin(escalation)} batches of margin)"
            if rolled.repeat_of is not None
            else ""
        )
        self.say(
            "torchvitals: ROLLBACK at step %d (%s): back to step %d, learning-rate scale "
            "%g, %s%s; rollback %d of at most %d within %d steps (ledger %s)",
            step,
            reason,
            rolled.to_step,
            rolled.lr_scale,
            what,
            again,
            policy.recent(tick),
            policy.max_rollbacks,
            policy.rollback_window,
            self.ledger.path,
        )
        return rolled

    def _give_up(self, step: int, why: str) -> NoReturn:
        """Abort on purpose: rolling back again would not cure the run."""
        self.ledger.record_abort(step, why)
        self.say(
            "torchvitals: ABORTING at step %d: %s. Rolling back again would not cure "
            "it; a person must look (ledger %s). Exit code %d.",
            step,
            why,
            self.ledger.path,
            self.abort_exit_code,
            error=True,
        )
        raise TrainingAborted(self.abort_exit_code, why)

    def _restore_target(
        self, model: torch.nn.Module, optimizer: Any, scheduler: Any
    ) -> Restored | None:
        """Restore the newest trusted checkpoint (from RAM when it is the copy held), going
        further back past one that fails to load or whose state does not come back as it was
        saved (``_check_state``); None when none is left."""
        self._compromised = False
        while (target := self.targets.target()) is not None:
            if target == self.targets.last_resort():
                self.say(
                    "torchvitals: no trusted checkpoint left: going back to step %d, which "
                    "trouble followed within trust_steps (%s)",
                    target,
                    self.targets.distrusted.get(target, ""),
                )
            restored = self.saver.restore(target, model, optimizer, scheduler)
            if restored is not None:
                if not (errors := self._check_state(target, model)):
                    return restored
                self._compromised = True
                self.say(
                    "torchvitals: the copy of step %d held in memory did not come back as "
                    "saved (%s); reading it from disk",
                    target,
                    errors,
                    error=True,
                )
            folder = self.store.folders(target)[1]
            if not self.store.on_leader(folder.is_dir):  # pruned (checkpoint_keep)
                self.targets.forget(target)
                continue
            self.on_phase(CHECKPOINT)
            try:
                restored = self.store.load(model, optimizer, scheduler, path=folder)
            except CheckpointError as e:  # every rank alike: the load is collective
                self._distrust(self.targets.distrust(target, f"it failed to load: {e}"))
                continue
            finally:
                self.on_phase(TRAIN)
            if errors := self._check_state(target, model):
                self._compromised = True
                self._distrust(
                    self.targets.distrust(target, f"its state did not come back as saved: {errors}")
                )
                continue
            self._compromised = False
            return restored
        return None

    def _check_state(self, step: int, model: torch.nn.Module) -> str:
        """Whether every rank's restored parameters are bitwise those it saved at ``step``
        (``state_fingerprint``); collective, every rank alike: ``""`` or which ranks' were not.
        Nothing to check (and no collective) for a checkpoint this process did not save: every
        rank saved the same steps, so every rank knows alike."""
        expected = self._fingerprints.get(step)
        if expected is None:
            return ""

        def check() -> None:
            got = state_fingerprint(model.parameters())
            if got != expected:
                raise ValueError(f"fingerprint {got:013x}, saved as {expected:013x}")

        return failures(self.store.gather(check))

    def say(self, message: str, *args: Any, error: bool = False) -> None:
        """One line for a person, on global rank 0 (every rank takes the same decision)."""
        if self.ledger.writer:
            (log.error if error else log.warning)(message, *args)

    def metrics(self) -> dict[str, float]:
        """The watchdog's numbers for the outputs (rollbacks, LR scale, checkpoint times...)."""
        return {
            "rollbacks": self.rollbacks,
            "rollback_repeats": self.rollback_repeats,
            "lr_scale": self.lr_scale,
            "last_healthy_step": float("nan") if self.last_healthy is None else self.last_healthy,
            "skipped_batches": self.ledger.skipped.batches(),
            "checkpoint_seconds": self.checkpoint_seconds,
            "checkpoint_stall_seconds": self.stall_seconds,
            "checkpoint_failures": self.failed_saves,
        }


def _active(detector: Any) -> list[Verdict]:
    """The detector's verdicts still holding, without the pinned wiring facts."""
    return [v for key, v in detector.active.items() if key not in detector.pinned]


def _targets(ledger: Ledger, trust_steps: int, verify_steps: int, keep: int) -> Targets:
    """The rollback targets as the ledger left them: the committed checkpoints it records as
    trusted (``trust`` records, or written before the ledger kept them), the others watched
    again, none it distrusted."""
    distrusted, trusted = ledger.distrusted(), ledger.trusted()
    committed = {e["step"]: e["path"] for e in ledger.entries if e["event"] == "checkpoint"}
    return Targets(
        trust_steps=trust_steps,
        verify_steps=verify_steps,
        keep=keep,
        committed=committed,
        trusted=[step for step, path in committed.items() if Path(path).name in trusted],
        distrusted={
            step: distrusted[Path(path).name]
            for step, path in committed.items()
            if Path(path).name in distrusted
        },
    )
