"""The per-rank agent: its collaborators, built once at ``watch()``, and the public API.

    agent = torchvitals.watch(model, optimizer, scheduler)
    for batch in loader:
        loss = compute_loss(model, batch)
        loss.backward()
        report = agent.step(loss)        # calls optimizer.step() unless the decision says skip
        optimizer.zero_grad(set_to_none=True)

The ``Agent`` declares what it holds at class level and reads top to bottom as its documented
public surface, the step's doors (``step``, and the patched ``optimizer.step()``,
``scaler.step`` and ``zero_grad``), the rest of the API, the hooks for integrations and
``close()``. ``build.py`` builds the collaborators at ``watch()``, in sections every rank fences
(the ranks' agreement on the blocks, the detector, the resources, the guard, the signals), then
the step, which receives them as one frozen record (``step.StepDeps``). What one step does is
``step.py``; the vital signs it packs are ``signals/`` (``signals/registry.py`` lists them). A
``watch()`` that fails releases what it already built (the /metrics port, the event log, hooks,
patches). Integrations reach the agent through its public surface (``on_close``, ``attach``,
``resume_at``, ``ticks``, ...), never through its private attributes.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .backends import OptimizerBackend
from .backends.optimizers import Optimizers
from .build import build
from .config import Config
from .detect.detector import Detector
from .detect.rules import Rule
from .guard import StepGuard
from .measure.blocks import Blocks
from .measure.datawait import DataWait
from .measure.loss import LossBook
from .measure.reduce import Reducer
from .measure.stages import Agreed
from .outputs.incidents import IncidentWriter
from .outputs.sinks import Outputs, Sink
from .outputs.timeline import Timeline
from .patches import AttributePatch, PatchSet
from .recover.batches import SkipAwareBatches
from .recover.directives import DirectivePoller
from .recover.heartbeat import Heartbeat
from .recover.watchdog import Watchdog
from .report import Report
from .signals.base import Signal
from .signals.registry import Signals
from .step import StageTimes, StepInput, Steps

F64 = torch.float64


class Adapter(Protocol):
    """A framework adapter the agent holds (``Agent.attach``): closed first at ``close()``."""

    def close(self) -> None: ...


PUBLIC = (
    # what it watches, and who this rank is
    "config",
    "model",
    "optimizer",
    "scheduler",
    "global_rank",
    "world_size",
    # where the run is
    "run_dir",
    "metrics_url",
    "resumed_from",
    "step_count",
    "ticks",
    "last_report",
    "block_names",
    # the data
    "batches",
    "data_position",
    "skipped_batches",
    "record_data_wait",
    # the learning rate
    "lr",
    "lr_scale",
    "scheduler_follows_step",
    # the step
    "step",
    "record_loss",
    "capture_gradients",
    "sampled",
    "stage_times",
    # what it found and where it went
    "detector",
    "watchdog",
    "outputs",
    "loss_book",
    "observe_validation",
    "diagnose",
    # the hooks for integrations, and the end
    "adapter",
    "attach",
    "on_close",
    "resume_at",
    "close",
)
"""The agent's public names, all of them (``Agent``'s docstring and docs/extending.md list
them; tests/unit/test_agent_surface.py keeps the three and the class the same). Everything
else on the agent is private: ``build.py`` fills it, ``agent.py`` uses it."""


class Agent:
    """Watches one rank's model and optimizer; see ``torchvitals.watch``.

    Everything is built once, at ``watch()`` (``build.py``), and released by ``close()``. The
    public surface is ``PUBLIC``, no more:

    - What it watches, and who this rank is: ``config``, ``model``, ``optimizer``,
      ``scheduler``, ``global_rank``, ``world_size``.
    - Where the run is: ``run_dir``, ``metrics_url``, ``resumed_from``, ``step_count``,
      ``ticks``, ``last_report``, ``block_names``.
    - The data: ``batches``, ``data_position``, ``skipped_batches``, ``record_data_wait``.
    - The learning rate: ``lr``, ``lr_scale``, ``scheduler_follows_step``.
    - The step: ``step``, ``record_loss``, ``capture_gradients``, ``sampled``,
      ``stage_times``.
    - What it found and where it went: ``detector`` (``history``, ``active``), ``watchdog``,
      ``outputs`` (``exporter``, the event log, the sinks' ``failures``), ``loss_book`` (what
      integrations set: ``capture``, ``share_scale``), ``observe_validation``, ``diagnose``.
    - The hooks for integrations, and the end: ``adapter``, ``attach``, ``on_close``,
      ``resume_at``, ``close`` (and ``with agent:``).
    """

    # ------------------------------------------------------------------ public
    config: Config
    """The settings every rank agreed on."""
    model: nn.Module
    optimizer: Any
    """The torch optimizer (or container) under any accelerate/DeepSpeed wrapper."""
    scheduler: Any
    global_rank: int
    """This process's rank in the job: what job-wide duties (global rank 0's event log,
    incidents, timeline and poller), heartbeats and metric labels go by."""
    world_size: int
    run_dir: str | None
    """Global rank 0's folder of this run under ``log_dir`` (None elsewhere, or without)."""
    resumed_from: int | None
    """The model step this run resumed after (None: it started fresh)."""
    last_report: Report | None
    """The newest step's report (None before the first)."""
    record_data_wait: Callable[[float], None]
    """Adapters: the seconds a batch drawn elsewhere (not through ``batches``) waited."""
    detector: Detector
    """The verdicts: ``history`` (oldest first, bounded) and the ``active`` ones."""
    watchdog: Watchdog | None
    """Checkpoints and rollbacks (None without ``checkpoint_dir``)."""
    outputs: Outputs
    """Where each report goes: /metrics (``exporter``), the event log, the live view, the
    user's sinks and their ``failures``."""
    loss_book: LossBook
    """Where each step's loss comes from (``record_loss``, the model's outputs)."""
    adapter: Adapter | None
    """The framework adapter ``attach`` holds (``watch_torchtitan``'s), or None."""

    # ------------------------------------------------------------------ private
    _backend: OptimizerBackend
    """The optimizer's kind (``backends/``): whose step the guard takes, where the gradients
    and the state are."""
    _optimizers: Optimizers
    """A container's real optimizers (or the one optimizer)."""
    _state_holder: Any
    """What checkpoints and rollbacks save and restore the optimizer state of."""
    _clock: Callable[[], float]
    _group: dist.ProcessGroup | None
    """The reduction's group: the job's world (None: the default group, or one process)."""
    _group_rank: int
    """This rank's position in the reduction's group, which packs by it (equal to
    ``global_rank``: the group spans the world, and ``new_group`` orders its ranks)."""
    _layout: Agreed
    _blocks: Blocks
    """The blocks every rank packs (the union over the ranks' pipeline stages, if any)."""
    _params: list[torch.Tensor]
    _device: torch.device
    _reducer: Reducer
    _heartbeat: Heartbeat | None
    _incidents: IncidentWriter | None
    """Global rank 0's incident records in the job's folder (None on the other ranks, and
    without a checkpoint or log folder)."""
    _timeline: Timeline | None
    """Global rank 0's step records for the goodput accounting (likewise)."""
    _poller: DirectivePoller | None
    """Global rank 0's collector poller (None on the other ranks and without a collector)."""
    _guard: StepGuard
    _signals: Signals
    _steps: Steps
    _wait: DataWait
    _data: SkipAwareBatches
    """The batch position and skip list (the watchdog's, so its checkpoints carry them)."""
    _patches: PatchSet
    _zero_grad: AttributePatch
    _validation: deque[tuple[int, float]]
    _closing: contextlib.ExitStack
    """Releases everything ``watch()`` built, in reverse (``close()``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        config: Config | None = None,
        settings: Mapping[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
        registry: Any = None,
        clock: Callable[[], float] = time.perf_counter,
        signals: Sequence[Signal] = (),
        rules: Sequence[Rule] = (),
        sinks: Sequence[Sink] = (),
    ):
        build(
            self,
            model,
            optimizer,
            scheduler,
            config=config,
            settings=settings,
            group=group,
            registry=registry,
            clock=clock,
            signals=signals,
            rules=rules,
            sinks=sinks,
        )

    # ------------------------------------------------------------------ the step's three doors

    def step(
        self,
        loss: torch.Tensor | float | None = None,
        *,
        samples: int | None = None,
        tokens: int | None = None,
        scaler: Any = None,
        closure: Callable[[], Any] | None = None,
    ) -> Report:
        """Measure this step, agree on it with every rank, then step the optimizer and the
        scheduler unless every rank skips or rolls back (a hand-written loop's one call).

        Args:
            loss: this rank's loss (a tensor, possibly on the device, or a float); with a
                GradScaler, the unscaled loss (``scaler.scale(loss).backward()`` as usual).
                None: the mean of this step's ``record_loss`` calls.
            samples, tokens: what this rank processed in the step (for samples/s, tokens/s).
            scaler: a ``torch.amp.GradScaler``: the agent unscales (unless the loop already
                did), measures, then steps the optimizer and updates the scaler itself (instead
                of ``scaler.step``/``update``).
            closure: recomputes this step's forward and backward passes on the same batch and
                returns the loss, like torch.optim's closures (the agent clears the gradients
                before calling it). Given on every rank, a ``loss_outlier`` step is computed
                once more (``rerun_outliers``): one that does not reproduce is a transient
                fault naming the rank whose loss changed (``report.rerun``). Not called on
                other steps.

        Returns:
            The Report, identical on every rank except its ``local_*``/``step_seconds`` fields.
        """
        return self._run(
            StepInput(
                loss=loss,
                samples=samples,
                tokens=tokens,
                scaler=scaler,
                update_scaler=scaler is not None,
                owns_scheduler=True,
                closure=closure,
            )
        )

    def _guarded_step(self, closure_loss: Any, repeated: bool) -> Report:
        """``optimizer.step()`` from the loop or a framework (see guard.StepGuard)."""
        return self._run(StepInput(closure_loss=closure_loss, repeated=repeated), checked=False)

    def _scaler_step(self, scaler: Any) -> None:
        """``scaler.step(optimizer)`` from the loop or a framework (see patches.ScalerStepPatch):
        the caller updates the scaler; the real step goes through the optimizer's attribute."""
        self._run(StepInput(scaler=scaler, through_attribute=True))

    def _settle_skipped(self) -> None:
        """``optimizer.zero_grad()`` or ``model.zero_grad()`` (the watched model, a module inside
        it or a wrapper around it) from the loop or a framework: gradients and losses of a
        backward pass that no step took are a step the framework skipped by itself (DeepSpeed's
        overflow, a GradScaler's, a loop's own test). That step is measured and reported as its
        own skip on every rank (the frameworks' skip is agreed), so its losses never reach the
        next step. Whichever door a rank clears through, the first settles and the step's marks
        make any later one a no-op, so every rank runs the one collective at the same point.
        A loop that clears the gradients itself (``p.grad = None``) calls nothing: by the next
        step its skipped gradients are gone and its losses are not told from the new ones, so
        that step is not settled (telling them apart would take a hook on every backward, and
        the settled step could only report its gradients as unmeasured)."""
        if (
            self._steps.aborted is None
            and self.loss_book.pending
            and self._guard.has_new_gradients()
            and not self._guard.closed
        ):
            self._run(StepInput(skipped_by_framework=True))

    def _run(self, inp: StepInput, checked: bool = True) -> Report:
        report = (
            self._guard.checked(lambda repeated: self._steps.run(replace(inp, repeated=repeated)))
            if checked
            else self._steps.run(inp)
        )
        self.last_report = report
        return report

    # ------------------------------------------------------------------ the rest of the API

    def batches(self, loader: Any) -> Any:
        """Iterate ``loader`` (each epoch), never yielding a skipped batch; resumable.

        The global batch position and the skip list live in the watchdog's checkpoints, so after
        a rollback or a restart every rank continues at the right batch (see ``sampler``).
        """
        return self._wait.timed(self._data.iterate(loader))

    @property
    def data_position(self) -> int:
        """Global index of the next batch ``batches`` draws."""
        return self._data.position

    @property
    def skipped_batches(self) -> list[tuple[int, int]]:
        """Half-open ranges of global batch indices that are never trained on."""
        return list(self._data.skipped)

    @property
    def lr_scale(self) -> float:
        """What the rollbacks' back-off has left of the learning rate (1.0 without watchdog)."""
        return self._steps.lr_scale

    @property
    def metrics_url(self) -> str | None:
        """The URL this rank's /metrics really serves: after a port fallback, the port it fell
        back to (also in the log, the heartbeat and the file_sd target). None: it serves none."""
        return self.outputs.metrics_url

    @property
    def step_count(self) -> int:
        """The model's step: steps taken, less those a rollback undid."""
        return self._steps.step_count

    @property
    def block_names(self) -> list[str]:
        """The blocks every rank packs, in order: what the reports' per-block fields are
        keyed by (the union over the ranks' pipeline stages, if any)."""
        return list(self._blocks.names)

    @property
    def scheduler_follows_step(self) -> bool:
        """Whoever calls ``optimizer.step()`` (a framework, the loop) steps ``scheduler`` right
        after each one; False for a scheduler stepped per epoch (a restart then takes no step)."""
        return self._steps.scheduler_follows_step

    @scheduler_follows_step.setter
    def scheduler_follows_step(self, value: bool) -> None:
        self._steps.scheduler_follows_step = bool(value)

    @property
    def stage_times(self) -> StageTimes | None:
        """Set a ``step.StageTimes`` to record the agent's host time per stage (benchmarks)."""
        return self._steps.stage_times

    @stage_times.setter
    def stage_times(self, value: StageTimes | None) -> None:
        self._steps.stage_times = value

    @property
    def ticks(self) -> int:
        """Steps run, rolled-back ones too: the loop guard's and the heartbeat's clock."""
        return self._steps.ticks

    def sampled(self, step: int) -> bool:
        """Whether ``step`` records activations (and carries the preceding update's ratio)."""
        return self._steps.sampled(step)

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Tell the agent a micro-batch's loss (unscaled); the step's loss is their mean.

        For loops and frameworks that call ``optimizer.step()`` themselves, and for gradient
        accumulation (call it once per micro-batch). No host sync: a tensor stays on its device.
        """
        self.loss_book.record(loss)

    @property
    def lr(self) -> list[float]:
        """Each param group's learning rate as the next step applies it (back-off included)."""
        return self._guard.effective_lr(self.lr_scale)

    def capture_gradients(self) -> None:
        """Measure this step's gradients now, before something changes them (a framework's
        gradient clipping): the report's grad norms are then the pre-clip ones. Called by the
        integrations, and by ``torch.nn.utils.clip_grad_norm_`` while a guard is active."""
        if self._steps.aborted is None:
            self._signals.grads.capture()

    def observe_validation(self, loss: torch.Tensor | float) -> float:
        """Report a validation loss; every rank must call it (it is averaged over the ranks).

        Args:
            loss: this rank's validation loss.

        Returns:
            The mean over the ranks, which the detector judges at the next step.
        """
        value = torch.tensor([float(loss)], dtype=F64)
        if self.world_size > 1:
            if self._reducer.device_collectives:
                value = value.to(self._device)
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self._group)
        mean = float(value.sum()) / self.world_size
        step = self._steps.step_count
        self.detector.observe_validation(step, mean)
        self._validation.append((step, mean))
        self.outputs.event({"event": "validation", "step": step, "loss": mean})
        return mean

    def diagnose(self) -> Any:
        """The decision-tree summary of the run so far (``torchvitals.agent.tools.diagnose``)."""
        from .tools.diagnose import diagnose

        return diagnose(self.detector.history, self._steps.losses, self._validation)

    # ------------------------------------------------------------------ hooks for integrations

    def on_close(self, fn: Callable[[], Any]) -> None:
        """Call ``fn`` at ``close()``, before the agent releases its own collaborators (the
        last one registered runs first), and on no other path: a failed ``watch()`` never
        returned an agent to register on."""
        self._closing.callback(fn)

    def attach(self, adapter: Adapter) -> None:
        """Hold a framework adapter as ``agent.adapter``; ``close()`` closes it first."""
        self.adapter = adapter
        self.on_close(adapter.close)

    def resume_at(self, step: int, load_seconds: float = 0.0) -> None:
        """The run continues after model step ``step`` because a framework loaded its own
        checkpoint of it (torchtitan's) in ``load_seconds``: the step count and
        ``resumed_from`` become ``step``, the next step records activations if it is a sampled
        one, and the goodput records book the load as checkpoint time. Call it on every rank,
        between steps."""
        self._steps.step_count = self.resumed_from = step
        if self._timeline is not None:
            self._timeline.loaded(load_seconds)
        if self._steps.sampled(step + 1):
            self._steps.arm()

    def close(self) -> None:
        """Give the optimizer its step back, remove hooks and patches, stop /metrics, close the
        event log, finish a checkpoint write in flight within ``checkpoint_close_timeout_s``
        (last: it may raise that it failed; see ``Watchdog.close``)."""
        self._closing.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def watch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    group: dist.ProcessGroup | None = None,
    registry: Any = None,
    signals: Sequence[Signal] = (),
    rules: Sequence[Rule] = (),
    sinks: Sequence[Sink] = (),
    **config: Any,
) -> Agent:
    """Start watching a model and its optimizer on this rank.

    Args:
        model: a plain module, a DDP-wrapped module, a ``fully_shard``-ed (FSDP2) module, or a
            DeepSpeed engine.
        optimizer: the optimizer ``agent.step`` steps: a torch optimizer, a wrapper holding
            one as ``.optimizer`` (accelerate's ``AcceleratedOptimizer``, DeepSpeed's
            ``engine.optimizer``; see ``backends``), or a container of optimizers shaped like
            torchtitan's ``OptimizersContainer`` (its ``step`` is guarded, the back-off applies
            to every optimizer inside it, their state is checkpointed; see ``backends``).
        scheduler: an LR scheduler stepped after each optimizer step (accelerate's
            ``AcceleratedScheduler``, or a container like torchtitan's
            ``LRSchedulersContainer``), or None.
        group: the process group to reduce over: the job's world (the default), or a group
            spanning it (a gloo group beside NCCL). A group over part of the world is refused:
            one job is one training, agreed over every rank.
        registry: a prometheus_client registry to export into (default: a fresh one).
        signals: your own ``torchvitals.Signal`` instances, packed after the built-in ones into
            the same reduction (no extra collective). Every rank must pass the same signals in
            the same order; ``watch()`` checks it and raises on every rank otherwise.
        rules: your own ``torchvitals.Rule`` instances, run after the built-in ones; a
            critical verdict acts like a built-in one (rollback with a watchdog).
        sinks: your own ``torchvitals.Sink`` instances: each gets every step's report on this
            rank; one that raises is logged once, then counted, and the training goes on.
        **config: any ``Config`` field; overrides ``TORCHVITALS_*`` variables.

    Returns:
        The Agent; call ``agent.step(loss)`` after each ``loss.backward()``.

    Raises:
        SettingsDifferError: on every rank, when the ranks were given different values of a
            setting that shapes the step (a ``ConfigError`` naming it, its values, ranks and
            sources).
        RankFailedError: on every rank, when ``watch()`` failed on some rank (naming it and its
            error); an error every rank met alike is raised as it is.
    """
    return Agent(
        model,
        optimizer,
        scheduler,
        settings=config,
        group=group,
        registry=registry,
        signals=signals,
        rules=rules,
        sinks=sinks,
    )
