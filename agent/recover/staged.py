"""Healthy checkpoints through host memory: stage, write in the background, roll back from RAM.

    staged = StagedSaves(store, max_bytes)           # store over groups.checkpoint_group(...)
    saved = staged.save(step, model, optimizer, scheduler, extra, rank_state)  # a saver.Saver
    outcome = staged.settle(reduced_flags, world)    # every step; the same on every rank
    staged.restore(step, model, optimizer, scheduler)   # a rollback, from RAM

One staged copy serves both the background write and the in-memory rollback: once every rank's
write succeeded it becomes the rollback target (the committed checkpoint on disk holds the same
state, so a rollback from memory and one from disk land on identical weights). Until then the
previous one stays the target, so two copies are held (the one no longer needed is kept for
its buffers, which the next staging reuses: no allocation and no page faults on the step): that
is what ``max_bytes`` bounds.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from .async_save import BackgroundSaver, Outcome
from .checkpoint import CheckpointStore
from .saver import Saved, SyncSaver
from .snapshot import Restored, Snapshot, live_tensors, restore, stage, state_bytes

log = logging.getLogger(__name__)


class StagedSaves:
    """This rank's staged copies and its background writer; a ``saver.Saver``.

    Args:
        store: the checkpoint store, over a group that only the writer uses while a save is in
            flight (see ``groups.checkpoint_group``).
        max_bytes: host memory allowed for the staged copies (two at most).
    """

    def __init__(self, store: CheckpointStore, max_bytes: int):
        self.store = store
        self.max_bytes = max_bytes
        self.saver = BackgroundSaver(store)
        self._sync = SyncSaver(store)
        self.memory: Snapshot | None = None
        """The last committed healthy state, in RAM: the in-process rollback target."""
        self._spare: Snapshot | None = None
        self._fits: bool | None = None
        self.stall_seconds = float("nan")
        """How long the last save stalled training (staging only)."""

    @property
    def in_flight(self) -> bool:
        return self.saver.in_flight

    @property
    def pending_step(self) -> int | None:
        return self.saver.pending_step

    def fits(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Whether two copies of the largest rank's state fit in ``max_bytes``; decided once.

        Collective the first time (one MAX over the checkpoint group, at the first save, when
        no write is in flight): every rank must take the same path, and FSDP2 shards of
        different sizes could make ranks answer differently.
        """
        if self._fits is None:
            need = torch.tensor(
                [2.0 * state_bytes(live_tensors(model, optimizer))], dtype=torch.float64
            )
            if self.store._distributed:
                dist.all_reduce(need, op=dist.ReduceOp.MAX, group=self.store._group)
            self._fits = need.item() <= self.max_bytes
            if not self._fits:
                log.warning(
                    "torchvitals: two copies of the largest rank's state (%.0f MB) exceed "
                    "snapshot_max_bytes (%.0f MB): healthy checkpoints are written "
                    "synchronously and rollbacks read them from disk",
                    need.item() / 1e6,
                    self.max_bytes / 1e6,
                )
        return self._fits

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        extra: dict[str, Any],
        rank_state: dict[str, Any] | None,
    ) -> Saved:
        """Stage and write ``step`` in the background, or synchronously when it does not fit."""
        if not self.fits(model, optimizer):
            return self._sync.save(step, model, optimizer, scheduler, extra, rank_state)
        earlier = self.begin(step, model, optimizer, scheduler, extra, rank_state)
        return Saved(stall_seconds=self.stall_seconds, earlier=earlier)

    def begin(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        extra: dict[str, Any],
        rank_state: dict[str, Any] | None,
    ) -> Outcome | None:
        """Stage ``step`` and start writing it; the stall is the staging alone.

        Returns:
            The outcome of a previous save still in flight, which had to end first (at most one
            write at a time); None when there was none.
        """
        previous = self.wait() if self.in_flight else None
        if previous is not None:
            log.warning(
                "torchvitals: the checkpoint of step %d was still being written when "
                "step %d was due; training waited for it",
                previous.step,
                step,
            )
        snap = stage(step, model, optimizer, scheduler, extra, rank_state, into=self._spare)
        self._spare = None
        self.stall_seconds = snap.stage_seconds
        self.saver.start(snap)
        return previous

    def flags(self) -> list[float]:
        """``[done, failed]`` of this rank's write, for the step's SUM reduction."""
        return self.saver.flags()

    def settle(self, reduced: list[float], world_size: int) -> Outcome | None:
        """The outcome of the save in flight once every rank is done, else None."""
        return self._keep(self.saver.settle(reduced, world_size))

    def wait(self, timeout: float | None = None) -> Outcome | None:
        """End the save in flight (every rank at the same step); None if none or timed out."""
        return self._keep(self.saver.wait(timeout))

    def _keep(self, outcome: Outcome | None) -> Outcome | None:
        if outcome is None:
            return None
        if outcome.ok:  # the new copy is the target; the old one's buffers are reused
            self._spare, self.memory = self.memory, outcome.snapshot
        else:  # the previous copy stays the target
            self._spare = outcome.snapshot
        return outcome

    def restore(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> Restored | None:
        """Restore ``step`` from RAM when it is the copy held, else None (read the disk)."""
        if self.memory is None or self.memory.step != step:
            return None
        return restore(self.memory, model, optimizer, scheduler)
