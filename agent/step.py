"""One training step, top to bottom: measure, reduce, detect, decide, act, publish.

    report = agent.step(loss)      # a hand-written loop
    optimizer.step()               # a framework, a nanoGPT-style script (the guard)
    scaler.step(optimizer)         # a GradScaler's step (routed by the agent's patch)

Each of those builds one ``StepInput`` and calls ``Steps.run``. Every rank runs the same code
on the same reduced numbers, so every rank takes the same action without another message: a
rank that saw NaN alone still makes every rank skip or roll back, and nobody waits in a
collective for a peer that went another way. ``Steps`` gets the collaborators it uses as one
frozen ``StepDeps`` record, built by ``agent.py`` at ``watch()``, never the agent itself.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

from ..protocol import ABORTED, CODES
from .compat.pytorch import foreach_mul_
from .config import Config
from .detect.detector import Detector
from .detect.observed import Observed
from .detect.verdict import COLLECTOR_DIRECTIVE, CRITICAL, OUTLIER_PATTERNS, ROLLBACK_LOOP, Verdict
from .guard import StepGuard, double_step_error
from .measure import scaler as amp
from .measure.loss import LossBook
from .measure.reduce import Packer, Reducer
from .measure.stats import local
from .outputs.incidents import IncidentWriter
from .outputs.sinks import Outputs
from .outputs.timeline import Timeline
from .recover import rerun
from .recover.directives import DirectivePoller
from .recover.heartbeat import Heartbeat
from .recover.watchdog import TrainingAborted, Watchdog
from .report import Action, RankLocal, Report, StepTiming
from .signals.activations import ActivationSignal
from .signals.base import Signal, StepContext
from .signals.update import UpdateRatioSignal

log = logging.getLogger(__name__)

STAGES = ("measure", "reduce", "detect", "act", "publish")
"""The stages ``StageTimes`` reports; ``act`` includes deciding, not the optimizer's own step."""

CURVE_KEPT = 100_000
"""Newest training losses (and validation losses, ``Agent.observe_validation``) kept for
``diagnose()``: 1.6 MB of (step, loss) pairs, far more than its tree reads."""


@dataclasses.dataclass(frozen=True)
class StepInput:
    """What the caller of one step knows: built by ``agent.step``, the guarded
    ``optimizer.step()`` and the GradScaler route alike."""

    loss: torch.Tensor | float | None = None
    """The loss given to ``agent.step`` (wins over every other source)."""
    closure_loss: Any = None
    """What the optimizer's closure returned."""
    closure: Callable[[], Any] | None = None
    """``agent.step(loss, closure=fn)``: ``fn`` recomputes the step's forward and backward on
    the same batch and returns the loss (a suspect step is computed once more: ``rerun``)."""
    samples: int | None = None
    tokens: int | None = None
    scaler: Any = None
    """The GradScaler the step goes through, or None."""
    update_scaler: bool = False
    """The agent calls ``scaler.update()`` (``agent.step(scaler=)``); else the caller does."""
    owns_scheduler: bool = False
    """The agent steps the scheduler after the real step (``agent.step``); else whoever called
    ``optimizer.step()`` steps it."""
    through_attribute: bool = False
    """The real step goes through the optimizer's current ``step`` attribute (a scaler's step:
    a framework's wrapper around it must see it)."""
    skipped_by_framework: bool = False
    """The framework skipped ``optimizer.step()`` itself on this rank (it cleared the gradients
    without one): the step is measured, and every rank skips it (``signals/loop.py``), never
    steps or rolls it back."""
    repeated: bool = False
    """No backward pass since this rank's last step (the guard's ``checked``): every rank raises
    ``DoubleStepError`` (``signals/loop.py``)."""


@dataclasses.dataclass(frozen=True)
class StepDeps:
    """The collaborators one step uses, built once at ``watch()`` (``agent.py``)."""

    config: Config
    clock: Callable[[], float]
    device: torch.device
    """Where the packed device values live."""
    rank: int
    """This rank in the reduction's group (what it packs by)."""
    global_rank: int
    """This rank in the job (whose duties, and what the logs name)."""
    world_size: int
    signals: tuple[Signal, ...]
    """In packing order (identical on every rank)."""
    update: UpdateRatioSignal | None
    """Snapshotted around the real step before a sampled one (also in ``signals``)."""
    activations: ActivationSignal | None
    """Armed before a sampled step (also in ``signals``)."""
    reducer: Reducer
    detector: Detector
    guard: StepGuard
    watchdog: Watchdog | None
    outputs: Outputs
    heartbeat: Heartbeat | None
    poller: DirectivePoller | None
    incidents: IncidentWriter | None
    """Global rank 0's incident records (None elsewhere, and without a job folder)."""
    timeline: Timeline | None
    """Global rank 0's step records for the goodput accounting (likewise)."""
    loss_book: LossBook
    model: nn.Module
    optimizer: Any
    """The torch optimizer (or container) a GradScaler unscales and steps."""
    state_holder: Any
    """What checkpoints and rollbacks save and restore the optimizer state of."""
    scheduler: Any
    params: list[torch.Tensor]
    """The watched parameters (the clipping scales their gradients)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What every rank does with the step."""

    action: Action
    """STEP, SKIP or ROLLBACK (an abort raises instead)."""
    reason: str = ""
    """The patterns behind a rollback (the critical ones) or an outlier's skip."""


def decide(
    report: Report, *, watchdog: bool, skip_nonfinite: bool, skip_outliers: bool = False
) -> Decision:
    """The step's action from its reduced report (identical on every rank).

    A critical verdict rolls back when there is a watchdog; a non-finite loss or gradient skips
    (always for a scaler's overflow, else when ``skip_nonfinite``); so does a one-step outlier
    (``OUTLIER_PATTERNS``) with a watchdog and ``skip_outliers``; anything else steps.
    """
    critical = sorted({v.pattern for v in report.verdicts if v.severity == CRITICAL})
    if critical and watchdog:
        return Decision(Action.ROLLBACK, ", ".join(critical))
    if report.nonfinite and (skip_nonfinite or report.overflow):
        return Decision(Action.SKIP)
    outliers = sorted({v.pattern for v in report.verdicts if v.pattern in OUTLIER_PATTERNS})
    if outliers and watchdog and skip_outliers:
        return Decision(Action.SKIP, ", ".join(outliers))
    return Decision(Action.STEP)


class StageTimes:
    """The agent's own host seconds per stage and per step kind (unsampled, sampled,
    checkpoint), for ``benchmarks/overhead.py``; off unless set on ``agent.stage_times``."""

    def __init__(self) -> None:
        self.samples: dict[str, dict[str, deque[float]]] = {}
        """Step kind -> stage -> seconds of the newest ``CURVE_KEPT`` steps of that kind."""

    def record(self, kind: str, seconds: dict[str, float]) -> None:
        stages = self.samples.setdefault(kind, {s: deque(maxlen=CURVE_KEPT) for s in STAGES})
        for stage, value in seconds.items():
            stages[stage].append(value)


class _Laps:
    """Seconds between marks, minus the time spent in the optimizer's own step."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.last = clock, clock()
        self.seconds: dict[str, float] = {}
        self.excluded = 0.0

    def lap(self, stage: str) -> None:
        now = self.clock()
        self.seconds[stage] = now - self.last - self.excluded
        self.last, self.excluded = now, 0.0


class Steps:
    """Runs each step with the agent's collaborators; holds the step count and what one step
    leaves for the next.

    Args:
        deps: the collaborators the step uses (built once in ``agent.py``).
        step_count: the model step the run starts after (a resumed checkpoint's step, or 0).
    """

    def __init__(self, deps: StepDeps, step_count: int = 0) -> None:
        self.deps = deps
        self.step_count = step_count
        self.ticks = 0
        """Steps run (rolled-back ones too): the loop guard's and the heartbeat's clock."""
        self.aborted: TrainingAborted | None = None
        self.last_end = deps.clock()
        self.forward_end = -math.inf
        self.losses: deque[tuple[int, float]] = deque(maxlen=CURVE_KEPT)  # for diagnose()
        self.detector_at: dict[int, Any] = {}  # step -> detector, per rollback target
        self.scheduler_follows_step = True
        """Whoever calls ``optimizer.step()`` (a framework, the loop) steps the scheduler right
        after each one; False for a scheduler stepped per epoch (a restart then takes no step)."""
        self.stage_times: StageTimes | None = None

    def sampled(self, step: int) -> bool:
        """Whether ``step`` records activations (and carries the preceding update's ratio)."""
        return step == 1 or step % self.deps.config.sample_every == 0

    def on_forward(self, module: Any, inputs: Any, output: Any) -> None:
        """Forward hook: the end of this rank's last forward pass (its compute time)."""
        self.forward_end = self.deps.clock()

    def arm(self) -> None:
        if self.deps.activations is not None:
            self.deps.activations.arm()

    def run(self, inp: StepInput) -> Report:
        """The whole step; the Report is identical on every rank but its ``local_*`` fields."""
        d = self.deps
        if self.aborted is not None:
            raise self.aborted  # a loop that swallowed the abort must not train on
        laps = _Laps(d.clock) if self.stage_times is not None else None
        step = self.step_count + 1

        # measure: every signal packs this rank's values into the step's one packed vector
        scaler = inp.scaler if amp.enabled(inp.scaler) else None
        ctx = self._context(step, inp, scaler)
        packer = Packer(d.device)
        handles = [signal.pack(ctx, packer) for signal in d.signals]
        # Whether this rank can compute the step again: a suspect step is re-run only when
        # every rank can (one host float, the same layout on every rank: the setting is agreed).
        closures = (
            packer.add_host_sum([1.0 if inp.closure is not None else 0.0])
            if self.can_rerun
            else None
        )
        if laps:
            laps.lap("measure")

        # reduce: one SUM (+ one MAX on sampled steps), one copy to the host, read back
        reduced = d.reducer.reduce(packer)
        report = Report(
            step=step,
            world_size=d.world_size,
            rank=d.rank,
            timing=StepTiming(step_seconds=ctx.step_seconds, compute_seconds=ctx.compute_seconds),
            local=RankLocal(samples=inp.samples, tokens=inp.tokens),
        )
        seen = Observed()
        for signal, handle in zip(d.signals, handles):
            signal.unpack(ctx, handle, reduced, report, seen)
        if seen.repeated[0]:  # some rank stepped twice on the same gradients: every rank stops
            if ctx.sampled:
                self.arm()  # the step is not taken: its number comes again, to be recorded
            raise double_step_error(*seen.repeated, d.world_size)
        report.nonfinite = report.nonfinite_loss or report.nonfinite_grad
        report.lr = d.guard.effective_lr(self.lr_scale)
        if laps:
            laps.lap("reduce")

        # detect: the rules over the report (an incident written now, before any rollback), and a
        # collector's order
        report.verdicts = d.detector.observe(report, seen)
        if closures is not None:
            self._rerun(report, inp, reduced.scalar(closures))
        if d.incidents is not None:
            d.incidents.seen(report, d.detector.active.values())
        self._directive(report, CODES.get(seen.directive) if d.config.collector_url else None)
        self.losses.append((step, report.loss))
        self.ticks += 1
        if d.watchdog is not None:
            d.watchdog.note(step, report.verdicts)
        if laps:
            laps.lap("detect")

        # decide and act: the same action on every rank
        decision = (
            Decision(Action.SKIP)
            if report.loop_skip_count  # some rank's loop skipped it: every rank does
            else decide(
                report,
                watchdog=d.watchdog is not None,
                skip_nonfinite=d.config.skip_nonfinite,
                skip_outliers=d.config.skip_outliers,
            )
        )
        checkpoint = 0.0  # seconds of the step spent in a restore or a save (goodput)
        if decision.action == Action.ROLLBACK:
            start = d.clock()
            self._rollback(report, decision.reason)
            checkpoint = d.clock() - start
        elif decision.action == Action.SKIP:
            report.action = Action.SKIP
        else:
            self._optimizer_step(report, inp, laps)
            start = d.clock()
            self._save(report, inp)
            if report.checkpoint.saved:
                checkpoint = d.clock() - start
        if d.incidents is not None:
            d.incidents.acted(report)
        if scaler is not None:
            amp.finish(
                scaler, d.optimizer, overflow=report.action != Action.STEP, update=inp.update_scaler
            )
        self.step_count = report.rollback.to_step if report.rollback else step
        if self.sampled(self.step_count + 1):
            self.arm()
        if laps:
            laps.lap("act")

        # publish: /metrics (read at scrape time), the event log, the live view, the heartbeat
        self._publish(report)
        if d.heartbeat is not None:
            d.heartbeat.beat(self.ticks)
        if d.timeline is not None:
            d.timeline.step(report, checkpoint_seconds=checkpoint)
        self.last_end = d.clock()
        if laps is not None and self.stage_times is not None:
            laps.lap("publish")
            kind = (
                "checkpoint"
                if report.checkpoint.saved
                else "sampled"
                if ctx.sampled or self.sampled(step + 1)
                else "unsampled"
            )
            self.stage_times.record(kind, laps.seconds)
        return report

    @property
    def can_rerun(self) -> bool:
        """Whether an outlier step may be computed again (then every step packs one float)."""
        c = self.deps.config
        return self.deps.watchdog is not None and c.skip_outliers and c.rerun_outliers

    def _rerun(self, report: Report, inp: StepInput, closures: float) -> None:
        """Every rank, same step: compute a suspect step once more when every rank can; one that
        does not reproduce adds a ``transient_fault`` verdict (the step is skipped either way)."""
        d = self.deps
        outlier = rerun.suspect(report, closures, d.world_size)
        if outlier is None or inp.closure is None:  # None: not every rank gave a closure
            return
        again = rerun.compute(inp.closure, d.params, report, outlier, d.device, d.rank)
        report.rerun = rerun.read(again, d.reducer.reduce(again.packer))
        if not report.rerun.reproduced:
            verdict = rerun.transient(report, outlier, report.rerun)
            report.verdicts.append(verdict)
            d.detector.history.append(verdict)
            d.detector.transient()

    @property
    def lr_scale(self) -> float:
        return self.deps.watchdog.lr_scale if self.deps.watchdog is not None else 1.0

    def _context(self, step: int, inp: StepInput, scaler: Any) -> StepContext:
        d = self.deps
        step_seconds = d.clock() - self.last_end
        compute = (
            self.forward_end - self.last_end if self.forward_end > self.last_end else step_seconds
        )
        # Unscaled before any signal measures: the norms are the real ones.
        scale = amp.unscale(scaler, d.optimizer) if scaler is not None else None
        return StepContext(
            step=step,
            sampled=self.sampled(step),
            step_seconds=step_seconds,
            compute_seconds=compute,
            loss=d.loss_book.take(inp.loss, inp.closure_loss),
            scale=scale,
            device=d.device,
            world_size=d.world_size,
            rank=d.rank,
            loop_skipped=inp.skipped_by_framework,
            repeated=inp.repeated,
        )

    def _optimizer_step(self, report: Report, inp: StepInput, laps: _Laps | None) -> None:
        """The real optimizer step (LR backed off), and the scheduler's when the agent owns it."""
        d = self.deps
        clip = d.config.clip_grad_norm
        if clip is not None and report.grad_norm_total > clip:
            report.clip_coef = clip / (report.grad_norm_total + 1e-6)
            grads = [local(p.grad) for p in d.params if p.grad is not None]
            if grads:
                foreach_mul_(grads, report.clip_coef)
        update = d.update if d.update is not None and self.sampled(report.step + 1) else None
        if update is not None:
            update.before_step()
        start = d.clock() if laps else 0.0
        d.guard.real_step(self.lr_scale, through_attribute=inp.through_attribute)
        if inp.owns_scheduler and d.scheduler is not None:
            d.scheduler.step()
        if laps:
            laps.excluded += d.clock() - start
        if update is not None:
            update.after_step(report.step, d.device)

    def _save(self, report: Report, inp: StepInput) -> None:
        """A healthy checkpoint when one is due (collective: identical on every rank)."""
        d = self.deps
        if d.watchdog is None:
            return
        report.checkpoint.saved = d.watchdog.maybe_save(
            report.step,
            d.model,
            d.state_holder,
            d.scheduler,
            d.detector,
            scheduler_step_due=not inp.owns_scheduler and self.scheduler_follows_step,
        )
        if report.checkpoint.saved:
            self.detector_at[report.step] = d.detector.snapshot()  # kept: committed + new
            keep = d.watchdog.targets.candidates()  # each checkpoint a rollback may restore
            self.detector_at = {s: snap for s, snap in self.detector_at.items() if s in keep}

    def _rollback(self, report: Report, reason: str) -> None:
        """Every rank, same step: back to the last healthy checkpoint, or skip without one."""
        d = self.deps
        assert d.watchdog is not None  # decide() rolls back only with a watchdog
        try:
            rolled = d.watchdog.rollback(
                report.step, self.ticks, reason, d.model, d.state_holder, d.scheduler
            )
        except TrainingAborted as aborted:
            self._abort(
                report,
                aborted,
                Verdict(
                    ROLLBACK_LOOP,
                    CRITICAL,
                    report.step,
                    None,
                    {
                        "reason": reason,
                        "why": aborted.why,
                        "max_rollbacks": d.config.max_rollbacks,
                        "rollback_window": d.config.rollback_window,
                        "exit_code": d.config.abort_exit_code,
                    },
                ),
            )
        if rolled is None:
            report.action = Action.SKIP
            return
        report.action, report.rollback = Action.ROLLBACK, rolled
        if d.update is not None:
            d.update.forget()
        if rolled.to_step in self.detector_at:
            d.detector.restore(self.detector_at[rolled.to_step])

    def _directive(self, report: Report, action: str | None) -> None:
        """Every rank, same step: a collector's directive becomes a critical verdict or an abort."""
        d = self.deps
        if action is None:
            return
        taken = d.poller.take() if d.poller is not None else None
        if taken is not None:
            log.warning(
                "torchvitals: collector directive %s (%s) at step %d",
                taken["id"],
                action,
                report.step,
            )
        verdict = Verdict(COLLECTOR_DIRECTIVE, CRITICAL, report.step, None, {"action": action})
        if action == Action.ABORT:
            if d.global_rank == 0:
                log.error(
                    "torchvitals: ABORTING at step %d: the collector ordered it (%s). "
                    "Exit code %d.",
                    report.step,
                    d.config.collector_url,
                    d.config.abort_exit_code,
                )
            self._abort(report, TrainingAborted(d.config.abort_exit_code), verdict)
        report.verdicts.append(verdict)
        d.detector.history.append(verdict)

    def _abort(self, report: Report, aborted: TrainingAborted, verdict: Verdict) -> NoReturn:
        """Publish the abort, tell the supervisor it is on purpose (torchrun turns every worker
        failure into exit status 1, so the exit code alone cannot say it), and raise."""
        d = self.deps
        self.aborted = aborted
        report.verdicts.append(verdict)
        d.detector.history.append(verdict)
        report.action = Action.ABORT
        if d.incidents is not None:
            d.incidents.aborted(report, verdict)
        self._publish(report)
        if d.heartbeat is not None:
            d.heartbeat.beat(self.ticks, phase=ABORTED)
        if d.timeline is not None:
            d.timeline.step(report)
        raise aborted

    def _publish(self, report: Report) -> None:
        watchdog = self.deps.watchdog
        self.deps.outputs.publish(
            report, self.deps.detector, watchdog.metrics() if watchdog is not None else None
        )
