"""How ``watch()`` builds a rank's agent: its collaborators, in sections every rank fences.

    agent = torchvitals.watch(model, optimizer)    # Agent.__init__ -> build(agent, ...)

``build`` runs ``watch()`` in sections of each rank's own work, each ending where every rank
meets (``consensus.Fence``): reading the settings and the model, the ranks' agreement on the
blocks (``measure.stages.agree``), what this rank builds alone (``_local``), the collectives
(``_join``: the checkpoint folder, the resume, who is who), and the hooks, patches, guard,
signals, job records and step (``_finish``). A rank that failed, or was given other settings,
stops every rank at the next fence with the same error, before any collective it would not
have joined; what was built is released (an ``ExitStack``), and a ``watch()`` that returns
hands it to the agent's ``close()``. The ``Agent`` (``agent.py``) declares what it holds; this
module fills it, and the step receives its collaborators as one frozen record
(``step.StepDeps``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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
from .measure.stages import agree
from .measure.stats import local
from .outputs.incidents import IncidentWriter, gather_places, supervisor_attempt
from .outputs.sinks import Outputs, Sink
from .outputs.timeline import Timeline
from .patches import PatchSet
from .recover.batches import SkipAwareBatches
from .recover.directives import DirectivePoller
from .recover.heartbeat import Heartbeat
from .recover.stacks import StackDumps
from .recover.trust import CheckpointKey
from .recover.watchdog import Watchdog
from .signals.base import Signal
from .signals.registry import BUILTIN, Signals, build_signals
from .signals.setup import Setup
from .step import CURVE_KEPT, StepDeps, Steps

log = logging.getLogger(__name__)


def build(
    agent: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    config: Config | None,
    settings: Mapping[str, Any] | None,
    group: dist.ProcessGroup | None,
    registry: Any,
    clock: Callable[[], float],
    signals: Sequence[Signal],
    rules: Sequence[Rule],
    sinks: Sequence[Sink],
) -> None:
    """Fill ``agent`` (an ``Agent`` under construction: typed ``Any`` here, since ``agent.py``
    imports this module) with every collaborator it declares; ``Agent.__init__``'s arguments.

    Raises:
        TorchvitalsError: on every rank alike when a section failed on any rank (see
            ``consensus.Fence``), after releasing what was built.
    """
    if config is not None and settings:
        raise TypeError("Agent takes a config or settings, not both")
    distributed = dist.is_available() and dist.is_initialized()
    agent.world_size = dist.get_world_size() if distributed else 1
    agent.global_rank = dist.get_rank() if distributed else 0
    agent._clock = clock
    agent.last_report = None
    agent.adapter = None
    agent._validation = deque(maxlen=CURVE_KEPT)
    # watch() in sections of each rank's own work, each ending where every rank meets
    # (consensus.Fence): a rank that failed, or was given other settings, stops every rank
    # there, before any collective it would not have joined.
    fence = Fence(agent.global_rank, agent.world_size)
    with contextlib.ExitStack() as built:
        with fence.section("reading the settings and the model") as agreed:
            agent.config = config if config is not None else Config.from_env(**(settings or {}))
            agreed.update(shaping(agent.config))
            agent._group, agent._group_rank = _group(group, distributed, agent.world_size)
            _check_ddp(model)
            agent._backend = choose(optimizer, log)  # the optimizer's kind, once: backends/
            agent._optimizers = agent._backend.optimizers  # a container's real optimizers
            optimizer = agent._optimizers.stepped
            agent.model, agent.optimizer = model, optimizer
            agent.scheduler = unwrap_scheduler(scheduler).logged(log)
            agent._state_holder = agent._backend.state_holder
            agent._backend.check_checkpointable(agent.config.checkpoint_dir)
            discovered = _discover(model, agent.config, agent._backend)
        agent._layout = agree(*discovered, agent._group, agent._group_rank, agent.world_size)
        with fence.section("building this rank's agent"):
            key = _local(agent, rules, registry, sinks, built)
        # the collectives: the checkpoint folder, the resume, who is who
        loaded, places = _join(agent, key, built)
        with fence.section("finishing watch()") as agreed:
            _finish(agent, optimizer, signals, loaded, places, built)
            agreed.update(_packed(agent._signals, agent._blocks))
        agent._closing = built.pop_all()


def _group(group: dist.ProcessGroup | None, distributed: bool, world_size: int) -> tuple[Any, int]:
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
    if group is not None and dist.get_world_size(group) != world_size:
        raise TorchvitalsError(
            f"torchvitals: watch(group=...) names ranks "
            f"{dist.get_process_group_ranks(group)} of the job's {world_size}: "
            "torchvitals watches one training per job, over all of its ranks, so that every "
            "rank takes the same action at the same step and global rank 0 writes the job's "
            "records. Leave group= out (ranks that hold different parts of one model, "
            "pipeline stages, are told apart by themselves), or run each training as a job "
            "of its own"
        )
    return group, dist.get_rank(group)


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


def _discover(
    model: nn.Module, config: Config, backend: OptimizerBackend
) -> tuple[Blocks, list[Any]]:
    """This rank's blocks and their wiring verdicts (before the ranks agree on them)."""
    blocks = discover(model, config.blocks)
    return blocks, wiring_verdicts(blocks, backend.stepped_params)


def _check_replicas(agent: Any) -> None:
    """A DDP model's process group must hold every rank with an identical copy of its blocks:
    copies outside it are another training's (two DDP groups, one job), whose gradients no
    reduction here may add as if they were replicas."""
    if not isinstance(agent.model, DistributedDataParallel) or agent.world_size == 1:
        return
    ddp = set(dist.get_process_group_ranks(agent.model.process_group))
    blocks = agent._blocks
    for name, holders, params in zip(blocks.names, blocks.holders, blocks.params):
        if params and not set(holders) <= ddp:
            raise TorchvitalsError(
                f"torchvitals: ranks {sorted(holders)} hold identical copies of block "
                f"{name!r}, but this rank's DDP process group keeps only ranks {sorted(ddp)} "
                "in step: two independent trainings in one job. torchvitals watches one "
                "training per job: run each as a job of its own"
            )


def _local(
    agent: Any,
    rules: Sequence[Rule],
    registry: Any,
    sinks: Sequence[Sink],
    built: contextlib.ExitStack,
) -> CheckpointKey | None:
    """What this rank builds alone once the blocks are agreed (no collective): the
    detector, the heartbeat and stack dumps, the checkpoint key, the collector's poller and
    /metrics, each released by ``built`` on failure. Returns the checkpoint key."""
    config, clock = agent.config, agent._clock
    agent._blocks = agent._layout.blocks
    _check_replicas(agent)
    agent._params = [p for ps in agent._blocks.params for _, p in ps]
    agent._device = local(agent._params[0]).device
    agent._reducer = Reducer(agent._group, agent.world_size)
    agent.detector = Detector(
        agent._blocks.names,
        agent._blocks.kinds,
        Thresholds.from_overrides(config.detect),
        static=agent._layout.static,
        rules=rules,
    )
    agent.loss_book = LossBook()
    agent._wait = DataWait(clock)
    agent.record_data_wait = agent._wait.record  # adapters: a batch drawn elsewhere
    # Every rank reads the token, so a missing secret fails every rank alike; only global
    # rank 0 polls.
    token = token_from_env() if config.collector_url else None
    agent._heartbeat = (
        Heartbeat(config.heartbeat_dir, agent.global_rank, flush=True)
        if config.heartbeat_dir
        else None
    )
    if agent._heartbeat is not None:
        built.callback(agent._heartbeat.close)
    if agent._heartbeat is not None and config.heartbeat_dir:
        _stacks(agent, config.heartbeat_dir, agent._heartbeat, built)
    # Only global rank 0 signs and checks the manifests, so only it reads the key.
    key = (
        CheckpointKey.from_env(key_file=config.checkpoint_key_file)
        if config.checkpoint_dir and agent.global_rank == 0
        else None
    )
    agent._poller = (
        DirectivePoller(
            config.collector_url,
            config.collector_job,
            config.collector_poll_seconds,
            token=token,
        )
        if config.collector_url and agent.global_rank == 0
        else None
    )
    if agent._poller is not None:
        built.callback(agent._poller.close)
    agent.outputs = Outputs(
        config,
        agent._blocks.names,
        rank=agent.global_rank,
        world_size=agent.world_size,
        registry=registry,
        sinks=sinks,
    )
    built.callback(agent.outputs.close)
    # An agent dropped without close() frees its port and event log too (the sinks hold
    # nothing of the agent, so this keeps nothing alive).
    weakref.finalize(agent, agent.outputs.close)
    agent.run_dir = agent.outputs.run_dir
    if agent._heartbeat is not None:
        agent._heartbeat.metrics_url = agent.outputs.metrics_url
    return key


def _join(agent: Any, key: CheckpointKey | None, built: contextlib.ExitStack) -> tuple[float, Any]:
    """The collectives of ``watch()``, every rank having built its part: the checkpoint
    folder proven shared and the ledger read (``Watchdog.open``), the run it holds
    resumed, and who each rank is (for the incidents). Each fails on every rank alike.

    Returns:
        The seconds the resume loaded for, and the ranks' places (None without a job folder).
    """
    config, model, heartbeat = agent.config, agent.model, agent._heartbeat
    try:
        agent.watchdog = (
            Watchdog.open(config, agent._group, key=key) if config.checkpoint_dir else None
        )
    except LedgerError:
        # A ledger that cannot be trusted stays so after a restart: the heartbeat says
        # "refused", so a supervisor exits with its refusal code instead of retrying.
        if heartbeat is not None:
            heartbeat.beat(0, REFUSED)
        raise
    if agent.watchdog is not None:
        built.callback(agent.watchdog.close)
    agent._data = agent.watchdog.data if agent.watchdog is not None else SkipAwareBatches()
    if heartbeat is not None and agent.watchdog is not None:
        agent.watchdog.on_phase = lambda phase: heartbeat.beat(phase=phase)
    if heartbeat is not None:
        heartbeat.beat(0, CHECKPOINT if agent.watchdog is not None else TRAIN)
    loading = time.time()
    agent.resumed_from = (
        agent.watchdog.resume(model, agent._state_holder, agent.scheduler)
        if agent.watchdog is not None
        else None
    )
    loaded = time.time() - loading if agent.resumed_from is not None else 0.0
    if heartbeat is not None:
        heartbeat.beat(0, TRAIN)
    # Who each rank is, gathered to global rank 0 for its incidents (once, never again);
    # the same on every rank: a job folder (the checkpoint folder, else the run's) is
    # known alike (both settings are agreed).
    places = (
        gather_places(agent._group, agent._group_rank, agent.world_size)
        if config.checkpoint_dir or config.log_dir
        else None
    )
    return loaded, places


def _finish(
    agent: Any,
    optimizer: torch.optim.Optimizer,
    signals: Sequence[Signal],
    loaded: float,
    places: Any,
    built: contextlib.ExitStack,
) -> None:
    """The hooks, patches and guard, the signals, global rank 0's job records and the
    step, each released by ``built`` on failure (no collective)."""
    model = agent.model
    built.callback(
        unwrap(model).register_forward_hook(agent.loss_book.capture_output, with_kwargs=True).remove
    )
    agent._patches = PatchSet()  # undone by close(), or when the agent is collected
    built.callback(agent._patches.close)
    agent._patches.close_when_collected(agent)
    agent._guard = StepGuard(
        agent._optimizers,
        agent._guarded_step,
        agent._params,
        agent._patches,
        stepper=agent._backend.stepper,
    )
    built.callback(agent._guard.close)
    agent._signals = _signals(agent, signals)
    for signal in agent._signals.all:
        built.callback(signal.close)
    agent._incidents, agent._timeline = _job_records(agent, built, loaded, places)
    agent._steps = Steps(_step_deps(agent), step_count=agent.resumed_from or 0)
    # Always on and O(1): the end of each forward pass, for per-rank compute time.
    built.callback(model.register_forward_hook(agent._steps.on_forward).remove)
    agent._patches.route_scaler_step(optimizer, agent._scaler_step)
    agent._zero_grad = agent._patches.before_zero_grad(optimizer, agent._settle_skipped)
    agent._patches.before_model_zero_grad(model, agent._settle_skipped)
    agent._patches.capture_clipping(agent.capture_gradients, agent._params)
    if agent._steps.sampled(agent._steps.step_count + 1):
        agent._steps.arm()


def _packed(signals: Signals, blocks: Blocks) -> dict[str, Setting]:
    """What every rank packs, in order: the signals (built-in and the user's) and the
    blocks; agreed at the last fence, so a rank given other signals stops every rank."""
    names = ";".join(f"{type(s).__module__}.{type(s).__qualname__}" for s in signals.all)
    shown = ", ".join(type(s).__qualname__ for s in signals.all)
    packed = ";".join(f"{n}:{k}" for n, k in zip(blocks.names, blocks.kinds))
    return {
        "signals": Setting(names, shown, "the settings and watch(signals=...)"),
        "blocks packed": Setting(packed, packed, "the agreed model"),
    }


def _job_records(
    agent: Any, built: contextlib.ExitStack, load_seconds: float, places: Any
) -> tuple[IncidentWriter | None, Timeline | None]:
    """Global rank 0's incidents and goodput step records, in the job's folder (the
    checkpoint folder, else the run's), naming the ranks ``_join`` gathered."""
    config = agent.config
    folder = config.checkpoint_dir or agent.run_dir
    if agent.global_rank != 0 or folder is None:
        return None, None
    attempt = supervisor_attempt()
    exporter = agent.outputs.exporter
    incidents = IncidentWriter(
        IncidentLog(folder),
        places,
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
        resumed=agent.resumed_from or 0,
        load_seconds=load_seconds,
    )
    built.callback(timeline.close)
    return incidents, timeline


def _stacks(agent: Any, folder: str, heartbeat: Heartbeat, built: contextlib.ExitStack) -> None:
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
    weakref.finalize(agent, release)  # an agent dropped without close() releases it too


def _signals(agent: Any, extra: Sequence[Signal]) -> Signals:
    """The built-in vital signs (``signals/registry.py``), then the user's, in the order
    every rank packs and reads them back."""
    setup = Setup(
        config=agent.config,
        layout=agent._layout,
        model=agent.model,
        params=agent._params,
        rank=agent._group_rank,
        world_size=agent.world_size,
        group=agent._group,
        device=agent._device,
        collective_device=(
            agent._device if agent._reducer.device_collectives else torch.device("cpu")
        ),
        thresholds=agent.detector.thresholds,
        loss_level=agent.detector.loss_level,
        probe_grads=agent._guard.probe_grads,
        grad_source=agent._backend.grad_source,
        param_source=agent._backend.param_source,
        stepped=agent._backend.stepped_params,
        data_wait=agent._wait,
        watchdog=agent.watchdog,
        poller=agent._poller,
    )
    return build_signals(BUILTIN, setup, extra)


def _step_deps(agent: Any) -> StepDeps:
    """What one step uses, as one frozen record (the step never holds the agent)."""
    return StepDeps(
        config=agent.config,
        clock=agent._clock,
        device=agent._device,
        rank=agent._group_rank,
        global_rank=agent.global_rank,
        world_size=agent.world_size,
        signals=agent._signals.all,
        update=agent._signals.update,
        activations=agent._signals.activations,
        reducer=agent._reducer,
        detector=agent.detector,
        guard=agent._guard,
        watchdog=agent.watchdog,
        outputs=agent.outputs,
        heartbeat=agent._heartbeat,
        poller=agent._poller,
        incidents=agent._incidents,
        timeline=agent._timeline,
        loss_book=agent.loss_book,
        model=agent.model,
        optimizer=agent.optimizer,
        state_holder=agent._state_holder,
        scheduler=agent.scheduler,
        params=agent._params,
    )
