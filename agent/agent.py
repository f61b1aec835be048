"""The per-rank agent: its collaborators, built once at ``watch()``, and the public API.

    agent = torchvitals.watch(model, optimizer, scheduler)
    for batch in loader:
        loss = compute_loss(model, batch)
        loss.backward()
        report = agent.step(loss)        # calls optimizer.step() unless the decision says skip
        optimizer.zero_grad(set_to_none=True)

The ``Agent`` declares what it holds at class level; ``watch()`` builds the collaborators in
order (the ranks' agreement on the blocks, the detector, the resources, the guard, the signals)
and then the step, which receives them as one frozen record (``step.StepDeps``). What one step
does is ``step.py``; the vital signs it packs are ``signals/`` (``signals/registry.py`` lists
them). A ``watch()`` that fails releases what it already built (the /metrics port, the event
log, hooks, patches). Integrations reach the agent through its public hooks (``on_close``,
``attach``, ``resume_at``, ``ticks``), never through its private attributes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import TorchvitalsError
from ..protocol import ATTEMPT_ENV, CHECKPOINT, REFUSED, TRAIN, token_from_env
from ..records.incidents import IncidentLog
from ..records.ledger import LedgerError
from ..records.timeline import StepTimeline
from .backends import OptimizerBackend, choose
from .backends.optimizers import Optimizers
from .backends.wrappers import unwrap_scheduler
from .compat.pytorch import ddp_localized
from .config import Config
from .consensus import Fence, Setting, shaping
from .detect.detector import Detector
from .detect.rules import Rule
from .detect.thresholds import Thresholds
from .detect.wiring import wiring_verdicts
from .guard import StepGuard
from .measure.blocks import Blocks, discover, unwrap
from .measure.datawait import DataWait
from .measure.loss import LossBook
from .measure.reduce import Reducer
from .measure.stages import Agreed, agree
from .measure.stats import local
from .outputs.incidents import IncidentWriter, gather_places, supervisor_attempt
from .outputs.sinks import Outputs, Sink
from .outputs.timeline import Timeline
from .patches import AttributePatch, PatchSet
from .recover.batches import SkipAwareBatches
from .recover.directives import DirectivePoller
from .recover.heartbeat import Heartbeat
from .recover.stacks import StackDumps
from .recover.trust import CheckpointKey
from .recover.watchdog import Watchdog
from .report import Report
from .signals.base import Signal
from .signals.registry import BUILTIN, Signals, build_signals
from .signals.setup import Setup
from .step import CURVE_KEPT, StageTimes, StepDeps, StepInput, Steps

F64 = torch.float64
log = logging.getLogger(__name__)


class Adapter(Protocol):
    """A framework adapter the agent holds (``Agent.attach``): closed first at ``close()``."""

    def close(self) -> None: ...


class Agent:
    """Watches one rank's model and optimizer; see ``torchvitals.watch``.

    Every collaborator below is built once, at ``watch()``, and released by ``close()``.
    """

    config: Config
    model: nn.Module
    optimizer: Any
    """The torch optimizer (or container) under any accelerate/DeepSpeed wrapper."""
    scheduler: Any
    backend: OptimizerBackend
    """The optimizer's kind (``backends/``): whose step the guard takes, where the gradients
    and the state are."""
    optimizers: Optimizers
    """A container's real optimizers (or the one optimizer)."""
    state_holder: Any
    """What checkpoints and rollbacks save and restore the optimizer state of."""
    clock: Callable[[], float]
    group: dist.ProcessGroup | None
    """The reduction's group: the job's world (None: the default group, or one process)."""
    global_rank: int
    """This process's rank in the job: what job-wide duties (global rank 0's event log,
    incidents, timeline and poller), heartbeats and metric labels go by."""
    group_rank: int
    """This rank's position in the reduction's group, which packs by it (equal to
    ``global_rank``: the group spans the world, and ``new_group`` orders its ranks)."""
    world_size: int
    layout: Agreed
    blocks: Blocks
    """The blocks every rank packs (the union over the ranks' pipeline stages, if any)."""
    params: list[torch.Tensor]
    device: torch.device
    reducer: Reducer
    detector: Detector
    loss_book: LossBook
    """Where each step's loss comes from (``record_loss``, the model's outputs)."""
    heartbeat: Heartbeat | None
    incidents: IncidentWriter | None
    """Global rank 0's incident records in the job's folder (None on the other ranks, and
    without a checkpoint or log folder)."""
    timeline: Timeline | None
    """Global rank 0's step records for the goodput accounting (likewise)."""
    watchdog: Watchdog | None
    """Checkpoints and rollbacks (None without ``checkpoint_dir``)."""
    poller: DirectivePoller | None
    """Global rank 0's collector poller (None on the other ranks and without a collector)."""
    outputs: Outputs
    run_dir: str | None
    resumed_from: int | None
    """The model step this run resumed after (None: it started fresh)."""
    guard: StepGuard
    signals: Signals
    steps: Steps
    last_report: Report | None
    adapter: Adapter | None
    """The framework adapter ``attach`` holds (``watch_torchtitan``'s), or None."""
    record_data_wait: Callable[[float], None]
    """Adapters: the seconds a batch drawn elsewhere (not through ``batches``) waited."""
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
        if config is not None and settings:
            raise TypeError("Agent takes a config or settings, not both")
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if distributed else 1
        self.global_rank = dist.get_rank() if distributed else 0
        self.clock = clock
        self.last_report = None
        self.adapter = None
        self._validation: deque[tuple[int, float]] = deque(maxlen=CURVE_KEPT)
        # watch() in sections of each rank's own work, each ending where every rank meets
        # (consensus.Fence): a rank that failed, or was given other settings, stops every rank
        # there, before any collective it would not have joined.
        fence = Fence(self.global_rank, self.world_size)
        with contextlib.ExitStack() as built:
            with fence.section("reading the settings and the model") as agreed:
                self.config = config if config is not None else Config.from_env(**(settings or {}))
                agreed.update(shaping(self.config))
                self.group, self.group_rank = self._group(group, distributed)
                self._check_ddp(model)
                self.backend = choose(optimizer, log)  # the optimizer's kind, once: backends/
                self.optimizers = self.backend.optimizers  # a container's real optimizers
                optimizer = self.optimizers.stepped
                self.model, self.optimizer = model, optimizer
                self.scheduler = unwrap_scheduler(scheduler).logged(log)
                self.state_holder = self.backend.state_holder
                self.backend.check_checkpointable(self.config.checkpoint_dir)
                discovered = self._discover(model)
            self.layout = agree(*discovered, self.group, self.group_rank, self.world_size)
            with fence.section("building this rank's agent"):
                self._local(rules, registry, sinks, built)
            self._join(built)  # the collectives: the checkpoint folder, the resume, who is who
            with fence.section("finishing watch()") as agreed:
                self._finish(optimizer, signals, built)
                agreed.update(self._packed())
            self._closing = built.pop_all()

    def _group(self, group: dist.ProcessGroup | None, distributed: bool) -> tuple[Any, int]:
        """The reduction's group and this rank in it: the job's whole world.

        One job is one training: its decisions are agreed over every rank, and its job-wide
        duties (the event log, the incidents, the timeline, the collector's poller) fall to
        global rank 0. A group over part of the world (two independent trainings in one job,
        each over its own ranks) is refused on every rank that passes one; a world-spanning
        group (``new_group`` over every rank, e.g. a gloo group beside NCCL) is taken, its
        ranks being the global ranks (``new_group`` orders them).
        """
        if not distributed:
            return None, 0
        if group is not None and dist.get_world_size(group) != self.world_size:
            raise TorchvitalsError(
                f"torchvitals: watch(group=...) names ranks "
                f"{dist.get_process_group_ranks(group)} of the job's {self.world_size}: "
                "torchvitals watches one training per job, over all of its ranks, so that every "
                "rank takes the same action at the same step and global rank 0 writes the job's "
                "records. Leave group= out (ranks that hold different parts of one model, "
                "pipeline stages, are told apart by themselves), or run each training as a job "
                "of its own"
            )
        return group, dist.get_rank(group)

    @staticmethod
    def _check_ddp(model: nn.Module) -> None:
        """DDP over a tensor-parallel model is refused (see the message)."""
        if isinstance(model, DistributedDataParallel) and ddp_localized(model):
            raise TorchvitalsError(
                "torchvitals: DistributedDataParallel over a tensor-parallel model is not "
                "supported: DDP turns the DTensor parameters into plain tensors of their local "
                "pieces, which cannot be told from whole parameters, and reduces over its "
                "data-parallel group only, so each tensor-parallel rank would judge its own "
                "piece. Shard the data-parallel dimension with fully_shard(model, mesh=dp_mesh) "
                "(FSDP x TP) instead"
            )

    def _discover(self, model: nn.Module) -> tuple[Blocks, list[Any]]:
        """This rank's blocks and their wiring verdicts (before the ranks agree on them)."""
        blocks = discover(model, self.config.blocks)
        return blocks, wiring_verdicts(blocks, self.backend.stepped_params)

    def _check_replicas(self) -> None:
        """A DDP model's process group must hold every rank with an identical copy of its blocks:
        copies outside it are another training's (two DDP groups, one job), whose gradients no
        reduction here may add as if they were replicas."""
        if not isinstance(self.model, DistributedDataParallel) or self.world_size == 1:
            return
        ddp = set(dist.get_process_group_ranks(self.model.process_group))
        for name, holders, params in zip(
            self.blocks.names, self.blocks.holders, self.blocks.params
        ):
            if params and not set(holders) <= ddp:
                raise TorchvitalsError(
                    f"torchvitals: ranks {sorted(holders)} hold identical copies of block "
                    f"{name!r}, but this rank's DDP process group keeps only ranks {sorted(ddp)} "
                    "in step: two independent trainings in one job. torchvitals watches one "
                    "training per job: run each as a job of its own"
                )

    def _local(
        self,
        rules: Sequence[Rule],
        registry: Any,
        sinks: Sequence[Sink],
        built: contextlib.ExitStack,
    ) -> None:
        """What this rank builds alone once the blocks are agreed (no collective): the
        detector, the heartbeat and stack dumps, the checkpoint key, the collector's poller and
        /metrics, each released by ``built`` on failure."""
        config, clock = self.config, self.clock
        self.blocks = self.layout.blocks
        self._check_replicas()
        self.params = [p for ps in self.blocks.params for _, p in ps]
        self.device = local(self.params[0]).device
        self.reducer = Reducer(self.group, self.world_size)
        self.detector = Detector(
            self.blocks.names,
            self.blocks.kinds,
            Thresholds.from_overrides(config.detect),
            static=self.layout.static,
            rules=rules,
        )
        self.loss_book = LossBook()
        self._wait = DataWait(clock)
        self.record_data_wait = self._wait.record  # adapters: a batch drawn elsewhere
        # Every rank reads the token, so a missing secret fails every rank alike; only global
        # rank 0 polls.
        token = token_from_env() if config.collector_url else None
        self.heartbeat = (
            Heartbeat(config.heartbeat_dir, self.global_rank, flush=True)
            if config.heartbeat_dir
            else None
        )
        if self.heartbeat is not None:
            built.callback(self.heartbeat.close)
        if self.heartbeat is not None and config.heartbeat_dir:
            self._stacks(config.heartbeat_dir, self.heartbeat, built)
        # Only global rank 0 signs and checks the manifests, so only it reads the key.
        self._key = (
            CheckpointKey.from_env(key_file=config.checkpoint_key_file)
            if config.checkpoint_dir and self.global_rank == 0
            else None
        )
        self.poller = (
            DirectivePoller(
                config.collector_url,
                config.collector_job,
                config.collector_poll_seconds,
                token=token,
            )
            if config.collector_url and self.global_rank == 0
            else None
        )
        if self.poller is not None:
            built.callback(self.poller.close)
        self.outputs = Outputs(
            config,
            self.blocks.names,
            rank=self.global_rank,
            world_size=self.world_size,
            registry=registry,
            sinks=sinks,
        )
        built.callback(self.outputs.close)
        # An agent dropped without close() frees its port and event log too (the sinks hold
        # nothing of the agent, so this keeps nothing alive).
        weakref.finalize(self, self.outputs.close)
        self.run_dir = self.outputs.run_dir
        if self.heartbeat is not None:
            self.heartbeat.metrics_url = self.outputs.metrics_url

    def _join(self, built: contextlib.ExitStack) -> None:
        """The collectives of ``watch()``, every rank having built its part: the checkpoint
        folder proven shared and the ledger read (``Watchdog.open``), the run it holds
        resumed, and who each rank is (for the incidents). Each fails on every rank alike."""
        config, model, heartbeat = self.config, self.model, self.heartbeat
        try:
            self.watchdog = (
                Watchdog.open(config, self.group, key=self._key) if config.checkpoint_dir else None
            )
        except LedgerError:
            # A ledger that cannot be trusted stays so after a restart: the heartbeat says
            # "refused", so a supervisor exits with its refusal code instead of retrying.
            if heartbeat is not None:
                heartbeat.beat(0, REFUSED)
            raise
        if self.watchdog is not None:
            built.callback(self.watchdog.close)
        self._data = self.watchdog.data if self.watchdog is not None else SkipAwareBatches()
        if heartbeat is not None and self.watchdog is not None:
            self.watchdog.on_phase = lambda phase: heartbeat.beat(phase=phase)
        if heartbeat is not None:
            heartbeat.beat(0, CHECKPOINT if self.watchdog is not None else TRAIN)
        loading = time.time()
        self.resumed_from = (
            self.watchdog.resume(model, self.state_holder, self.scheduler)
            if self.watchdog is not None
            else None
        )
        self._loaded = time.time() - loading if self.resumed_from is not None else 0.0
        if heartbeat is not None:
            heartbeat.beat(0, TRAIN)
        # Who each rank is, gathered to global rank 0 for its incidents (once, never again);
        # the same on every rank: a job folder (the checkpoint folder, else the run's) is
        # known alike (both settings are agreed).
        self._places = (
            gather_places(self.group, self.group_rank, self.world_size)
            if config.checkpoint_dir or config.log_dir
            else None
        )

    def _finish(
        self, optimizer: torch.optim.Optimizer, signals: Sequence[Signal], built: Any
    ) -> None:
        """The hooks, patches and guard, the signals, global rank 0's job records and the
        step, each released by ``built`` on failure (no collective)."""
        model = self.model
        built.callback(
            unwrap(model)
            .register_forward_hook(self.loss_book.capture_output, with_kwargs=True)
            .remove
        )
        self._patches = PatchSet()  # undone by close(), or when the agent is collected
        built.callback(self._patches.close)
        self._patches.close_when_collected(self)
        self.guard = StepGuard(
            self.optimizers,
            self._guarded_step,
            self.params,
            self._patches,
            stepper=self.backend.stepper,
        )
        built.callback(self.guard.close)
        self.signals = self._signals(signals)
        for signal in self.signals.all:
            built.callback(signal.close)
        self.incidents, self.timeline = self._job_records(built, self._loaded)
        self.steps = Steps(self._step_deps(), step_count=self.resumed_from or 0)
        # Always on and O(1): the end of each forward pass, for per-rank compute time.
        built.callback(model.register_forward_hook(self.steps.on_forward).remove)
        self._patches.route_scaler_step(optimizer, self._scaler_step)
        self._zero_grad = self._patches.before_zero_grad(optimizer, self.settle_skipped)
        self._patches.before_model_zero_grad(model, self.settle_skipped)
        self._patches.capture_clipping(self.capture_gradients, self.params)
        if self.steps.sampled(self.steps.step_count + 1):
            self.steps.arm()

    def _packed(self) -> dict[str, Setting]:
        """What every rank packs, in order: the signals (built-in and the user's) and the
        blocks; agreed at the last fence, so a rank given other signals stops every rank."""
        names = ";".join(f"{type(s).__module__}.{type(s).__qualname__}" for s in self.signals.all)
        shown = ", ".join(type(s).__qualname__ for s in self.signals.all)
        blocks = ";".join(f"{n}:{k}" for n, k in zip(self.blocks.names, self.blocks.kinds))
        return {
            "signals": Setting(names, shown, "the settings and watch(signals=...)"),
            "blocks packed": Setting(blocks, blocks, "the agreed model"),
        }

    def _job_records(
        self, built: contextlib.ExitStack, load_seconds: float
    ) -> tuple[IncidentWriter | None, Timeline | None]:
        """Global rank 0's incidents and goodput step records, in the job's folder (the
        checkpoint folder, else the run's), naming the ranks ``_join`` gathered."""
        config = self.config
        folder = config.checkpoint_dir or self.run_dir
        if self.global_rank != 0 or folder is None:
            return None, None
        attempt = supervisor_attempt()
        exporter = self.outputs.exporter
        incidents = IncidentWriter(
            IncidentLog(folder),
            self._places,
            attempt=attempt,
            supervised=ATTEMPT_ENV in os.environ,
            on_record=lambda i: exporter.count_incident(
                i.kind, i.culprit.rank, i.culprit.node, i.culprit.host
            ),
        )
        built.callback(incidents.close)
        timeline = Timeline(
            StepTimeline(folder, attempt=attempt),
            at=time.time(),
            resumed=self.resumed_from or 0,
            load_seconds=load_seconds,
        )
        built.callback(timeline.close)
        return incidents, timeline

    def _stacks(self, folder: str, heartbeat: Heartbeat, built: contextlib.ExitStack) -> None:
        """Every thread's stack on the stack signal, for the supervisor (``recover/stacks.py``),
        named in every heartbeat; unregistered, and the heartbeat told, on every exit path."""
        stacks = StackDumps.open(folder, heartbeat.rank)
        if stacks is None:
            return
        heartbeat.stack_signal = stacks.signum

        def release() -> None:
            heartbeat.forget_stacks()  # first: nothing is sent once it is unregistered
            stacks.close()

        built.callback(release)
        weakref.finalize(self, release)  # an agent dropped without close() releases it too

    def _signals(self, extra: Sequence[Signal]) -> Signals:
        """The built-in vital signs (``signals/registry.py``), then the user's, in the order
        every rank packs and reads them back."""
        setup = Setup(
            config=self.config,
            layout=self.layout,
            model=self.model,
            params=self.params,
            rank=self.group_rank,
            world_size=self.world_size,
            group=self.group,
            device=self.device,
            collective_device=(
                self.device if self.reducer.device_collectives else torch.device("cpu")
            ),
            thresholds=self.detector.thresholds,
            probe_grads=self.guard.probe_grads,
            grad_source=self.backend.grad_source,
            param_source=self.backend.param_source,
            stepped=self.backend.stepped_params,
            data_wait=self._wait,
            watchdog=self.watchdog,
            poller=self.poller,
        )
        return build_signals(BUILTIN, setup, extra)

    def _step_deps(self) -> StepDeps:
        return StepDeps(
            config=self.config,
            clock=self.clock,
            device=self.device,
            rank=self.group_rank,
            global_rank=self.global_rank,
            world_size=self.world_size,
            signals=self.signals.all,
            update=self.signals.update,
            activations=self.signals.activations,
            reducer=self.reducer,
            detector=self.detector,
            guard=self.guard,
            watchdog=self.watchdog,
            outputs=self.outputs,
            heartbeat=self.heartbeat,
            poller=self.poller,
            incidents=self.incidents,
            timeline=self.timeline,
            loss_book=self.loss_book,
            model=self.model,
            optimizer=self.optimizer,
            state_holder=self.state_holder,
            scheduler=self.scheduler,
            params=self.params,
        )

    # ------------------------------------------------------------------ the step's three doors

    def step(
        self,
        loss: torch.Tensor | float | None = None,
        *,
        samples: int | None = None,
        tokens: int | None = None,
        scaler: Any = None,
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
            )
        )

    def _guarded_step(self, closure_loss: Any, repeated: bool) -> Report:
        """``optimizer.step()`` from the loop or a framework (see guard.StepGuard)."""
        return self._run(StepInput(closure_loss=closure_loss, repeated=repeated), checked=False)

    def _scaler_step(self, scaler: Any) -> None:
        """``scaler.step(optimizer)`` from the loop or a framework (see patches.ScalerStepPatch):
        the caller updates the scaler; the real step goes through the optimizer's attribute."""
        self._run(StepInput(scaler=scaler, through_attribute=True))

    def settle_skipped(self) -> None:
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
            self.steps.aborted is None
            and self.loss_book.pending
            and self.guard.has_new_gradients()
            and not self.guard.closed
        ):
            self._run(StepInput(skipped_by_framework=True))

    def _run(self, inp: StepInput, checked: bool = True) -> Report:
        report = (
            self.guard.checked(lambda repeated: self.steps.run(replace(inp, repeated=repeated)))
            if checked
            else self.steps.run(inp)
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
        return self.steps.lr_scale

    @property
    def metrics_url(self) -> str | None:
        """The URL this rank's /metrics really serves: after a port fallback, the port it fell
        back to (also in the log, the heartbeat and the file_sd target). None: it serves none."""
        return self.outputs.metrics_url

    @property
    def step_count(self) -> int:
        """The model's step: steps taken, less those a rollback undid."""
        return self.steps.step_count

    @property
    def scheduler_follows_step(self) -> bool:
        """Whoever calls ``optimizer.step()`` (a framework, the loop) steps ``scheduler`` right
        after each one; False for a scheduler stepped per epoch (a restart then takes no step)."""
        return self.steps.scheduler_follows_step

    @scheduler_follows_step.setter
    def scheduler_follows_step(self, value: bool) -> None:
        self.steps.scheduler_follows_step = bool(value)

    @property
    def stage_times(self) -> StageTimes | None:
        """Set a ``step.StageTimes`` to record the agent's host time per stage (benchmarks)."""
        return self.steps.stage_times

    @stage_times.setter
    def stage_times(self, value: StageTimes | None) -> None:
        self.steps.stage_times = value

    @property
    def ticks(self) -> int:
        """Steps run, rolled-back ones too: the loop guard's and the heartbeat's clock."""
        return self.steps.ticks

    def sampled(self, step: int) -> bool:
        """Whether ``step`` records activations (and carries the preceding update's ratio)."""
        return self.steps.sampled(step)

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Tell the agent a micro-batch's loss (unscaled); the step's loss is their mean.

        For loops and frameworks that call ``optimizer.step()`` themselves, and for gradient
        accumulation (call it once per micro-batch). No host sync: a tensor stays on its device.
        """
        self.loss_book.record(loss)

    @property
    def lr(self) -> list[float]:
        """Each param group's learning rate as the next step applies it (back-off included)."""
        return self.guard.effective_lr(self.lr_scale)

    def capture_gradients(self) -> None:
        """Measure this step's gradients now, before something changes them (a framework's
        gradient clipping): the report's grad norms are then the pre-clip ones. Called by the
        integrations, and by ``torch.nn.utils.clip_grad_norm_`` while a guard is active."""
        if self.steps.aborted is None:
            self.signals.grads.capture()

    def observe_validation(self, loss: torch.Tensor | float) -> float:
        """Report a validation loss; every rank must call it (it is averaged over the ranks).

        Args:
            loss: this rank's validation loss.

        Returns:
            The mean over the ranks, which the detector judges at the next step.
        """
        value = torch.tensor([float(loss)], dtype=F64)
        if self.world_size > 1:
            if self.reducer.device_collectives:
                value = value.to(self.device)
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group)
        mean = float(value.sum()) / self.world_size
        step = self.steps.step_count
        self.detector.observe_validation(step, mean)
        self._validation.append((step, mean))
        self.outputs.event({"event": "validation", "step": step, "loss": mean})
        return mean

    def diagnose(self) -> Any:
        """The decision-tree summary of the run so far (``torchvitals.agent.tools.diagnose``)."""
        from .tools.diagnose import diagnose

        return diagnose(self.detector.history, self.steps.losses, self._validation)

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
        self.steps.step_count = self.resumed_from = step
        if self.timeline is not None:
            self.timeline.loaded(load_seconds)
        if self.steps.sampled(step + 1):
            self.steps.arm()

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
