"""The per-rank agent: measure, reduce, decide, export — once per training step.

    agent = torchvitals.watch(model, optimizer, scheduler)
    for batch in loader:
        loss = compute_loss(model, batch)
        loss.backward()
        report = agent.step(loss)        # calls optimizer.step() unless the decision says skip
        optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..protocol import CHECKPOINT, TRAIN, token_from_env
from .config import Config
from .detect.detector import Detector
from .detect.straggler import RankTiming
from .detect.thresholds import Thresholds
from .detect.wiring import wiring_verdicts
from .guard import (ClipWatch, StepGuard, intercept_clipping, intercept_scaler_step,
                    same_tensors)
from .measure.activations import ActivationStats
from .measure.attention import AttentionStats
from .measure.blocks import Blocks, discover, unwrap
from .measure.loss import LossBook
from .measure.reduce import Reducer
from .measure.stats import GradStats, UpdateRatio, local
from .measure.vitals import StepVitals
from .outputs.sinks import Outputs
from .pipeline import StepPipeline
from .recover.batches import SkipAwareBatches
from .recover.directives import DirectivePoller
from .recover.heartbeat import Heartbeat
from .recover.watchdog import TrainingAborted, Watchdog
from .report import Report

F64 = torch.float64
log = logging.getLogger(__name__)


class Agent(StepPipeline):
    """Watches one rank's model and optimizer; see ``torchvitals.watch``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 *, config: Config | None = None, group: dist.ProcessGroup | None = None,
                 registry: Any = None, clock: Callable[[], float] = time.perf_counter):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scheduler_follows_step = True
        """Whoever calls ``optimizer.step()`` (a framework, the loop) steps ``scheduler`` right
        after each one; False for a scheduler stepped per epoch (a restart then takes no step)."""
        self.config = config or Config.from_env()
        self._clock = clock
        distributed = dist.is_available() and dist.is_initialized()
        if group is None and isinstance(model, DistributedDataParallel):
            group = model.process_group
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.blocks: Blocks = discover(model, self.config.blocks)
        params = [p for ps in self.blocks.params for _, p in ps]
        self._params = params
        sharded = any(isinstance(p, DTensor) for p in params)
        split = self.config.split_ddp_work and self.world_size > 1 and not sharded
        n = len(self.blocks)
        owned = [(b % self.world_size == self.rank) if split else True for b in range(n)]
        self.device = local(params[0]).device
        self._grads = GradStats(self.blocks, owned, self.world_size, split)
        self._update = (UpdateRatio(self.blocks, owned, self.world_size, split,
                                    self.config.update_ratio_max_bytes)
                        if self.config.update_ratio else None)
        self._acts = (ActivationStats(self.blocks.output_modules, self.config.saturation_level)
                      if self.config.activations else None)
        self._attn = AttentionStats(unwrap(model), self.blocks) if self.config.activations else None
        self._reducer = Reducer(group if distributed else None, self.world_size)
        self._group = group if distributed else None
        self.detector = Detector(self.blocks.names, self.blocks.kinds,
                                 Thresholds.from_overrides(self.config.detect),
                                 static=wiring_verdicts(self.blocks, optimizer))
        self._timing = RankTiming(self.detector.thresholds, self.rank, self.world_size)
        self._vitals = StepVitals(model, self.blocks, self.device, self._group, self._reducer, clock)
        self.record_data_wait = self._vitals.wait.record  # adapters: a batch drawn elsewhere
        self.watchdog = Watchdog.open(self.config, self._group) if self.config.checkpoint_dir else None
        self._data = self.watchdog.data if self.watchdog is not None else SkipAwareBatches()
        self._ticks = 0
        self._detector_at: dict[int, Any] = {}   # step -> detector, per rollback target
        # Every rank reads the token, so a missing secret fails every rank alike, not rank 0
        # alone while the others wait in a collective; only rank 0 polls.
        token = token_from_env() if self.config.collector_url else None
        self._poller = (DirectivePoller(self.config.collector_url, self.config.collector_job,
                                        self.config.collector_poll_seconds, token=token)
                        if self.config.collector_url and self.rank == 0 else None)
        self._out = Outputs(self.config, self.blocks.names, rank=self.rank,
                            world_size=self.world_size, registry=registry)
        self.run_dir = self._out.run_dir
        self.step_count = 0
        self._aborted: TrainingAborted | None = None
        # For diagnose(): bounded, so a million-step run does not grow the agent.
        self._losses: deque[tuple[int, float]] = deque(maxlen=100_000)
        self._validation: list[tuple[int, float]] = []
        self._pending_update: tuple[torch.Tensor, torch.Tensor, list[bool], int] | None = None
        self.heartbeat = (Heartbeat(self.config.heartbeat_dir, self.rank)
                          if self.config.heartbeat_dir else None)
        if self.heartbeat is not None and self.watchdog is not None:
            self.watchdog.on_phase = lambda phase: self.heartbeat.beat(phase=phase)
        if self.heartbeat is not None:
            self.heartbeat.beat(0, CHECKPOINT if self.watchdog is not None else TRAIN)
        self.resumed_from = (self.watchdog.resume(model, optimizer, scheduler)
                             if self.watchdog is not None else None)
        if self.resumed_from is not None:
            self.step_count = self.resumed_from
        if self.heartbeat is not None:
            self.heartbeat.beat(0, TRAIN)
        self._last_end = clock()
        self._forward_end = -math.inf
        # Always on and O(1): the end of each forward pass, for per-rank compute time.
        self._forward_hook = model.register_forward_hook(self._on_forward)
        self.loss_book = LossBook()
        """Where each step's loss comes from (``record_loss``, the model's outputs)."""
        self._loss_hook = unwrap(model).register_forward_hook(self.loss_book.capture_output,
                                                             with_kwargs=True)
        self._call: dict[str, Any] | None = None
        self._captured: torch.Tensor | None = None
        self._captured_from: list[Any] = []     # the gradients it was measured from
        self.last_report: Report | None = None
        """The report of the last step (what a framework's ``optimizer.step()`` produced)."""
        self._clip_check = ClipWatch(log=log if self.rank == 0 else None)
        self._guard = StepGuard(optimizer, self._run_step, params)
        self._loop_scaler: Any = None
        self._release_scaler = intercept_scaler_step(optimizer, self._scaler_step)
        self._release_clip = intercept_clipping(self.capture_gradients, params)
        if self.sampled(self.step_count + 1):
            self._arm()

    def batches(self, loader: Any) -> Any:
        """Iterate ``loader`` (each epoch), never yielding a skipped batch; resumable.

        The global batch position and the skip list live in the watchdog's checkpoints, so after
        a rollback or a restart every rank continues at the right batch (see ``sampler``).
        """
        return self._vitals.wait.timed(self._data.iterate(loader))

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
        return self.watchdog.lr_scale if self.watchdog is not None else 1.0

    @property
    def metrics_url(self) -> str | None:
        return self._out.exporter.url

    def sampled(self, step: int) -> bool:
        """Whether ``step`` records activations (and carries the preceding update's ratio)."""
        return step == 1 or step % self.config.sample_every == 0

    def step(self, loss: torch.Tensor | float | None = None, *, samples: int | None = None,
             tokens: int | None = None, scaler: Any = None) -> Report:
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
        self._call = {"loss": loss, "samples": samples, "tokens": tokens, "scaler": scaler}
        try:
            self.optimizer.step()           # the guard runs _run_step
        finally:
            self._call = None
        return self.last_report

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
        now = self._guard.probe_grads()
        if self._captured is not None and not same_tensors(now, self._captured_from):
            self._captured = None     # a new backward since: the loop skipped that step itself
        if self._captured is None and self._aborted is None:
            self._captured, self._captured_from = self._grads.block_sq(self.device), now

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
                value = value.to(self.device)
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self._group)
        mean = float(value.sum()) / self.world_size
        self.detector.observe_validation(self.step_count, mean)
        self._validation.append((self.step_count, mean))
        self._out.event({"event": "validation", "step": self.step_count, "loss": mean})
        return mean

    def diagnose(self) -> Any:
        """The decision-tree summary of the run so far (see ``torchvitals.agent.tools.diagnose``)."""
        from .tools.diagnose import diagnose
        return diagnose(self.detector.history, self._losses, self._validation)

    def close(self) -> None:
        """Give the optimizer its step back, remove hooks, stop /metrics, close the event log,
        finish a checkpoint write in flight."""
        self._guard.close()
        self._release_scaler()
        self._release_clip()
        self._loss_hook.remove()
        self._forward_hook.remove()
        if self._poller is not None:
            self._poller.close()
        if self._acts is not None:
            self._acts.close()
            self._attn.close()
        self._out.close()
        if self.watchdog is not None:   # last: it may raise that the final write failed
            self.watchdog.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def watch(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None, *,
          group: dist.ProcessGroup | None = None, registry: Any = None, **config: Any) -> Agent:
    """Start watching a model and its optimizer on this rank.

    Args:
        model: a plain module, a DDP-wrapped module, or a ``fully_shard``-ed (FSDP2) module.
        optimizer: the optimizer ``agent.step`` steps.
        scheduler: an LR scheduler stepped after each optimizer step, or None.
        group: the process group to reduce over (default: DDP's, else the world).
        registry: a prometheus_client registry to export into (default: a fresh one).
        **config: any ``Config`` field; overrides ``TORCHVITALS_*`` variables.

    Returns:
        The Agent; call ``agent.step(loss)`` after each ``loss.backward()``.
    """
    return Agent(model, optimizer, scheduler, config=Config.from_env(**config), group=group,
                 registry=registry)
