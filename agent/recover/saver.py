"""How a healthy checkpoint gets written: one interface over the synchronous and the staged saves.

    saver = SyncSaver(store)                         # or staged.StagedSaves(store, max_bytes)
    saved = saver.save(step, model, optimizer, scheduler, extra, rank_state)
    packer.add_host_sum(..., saver.flags())          # every step: [done, failed] of a write
    outcome = saver.settle(reduced, world_size)      # a background write ended on every rank
    saver.wait()                                     # before a rollback; at close, bounded
    saver.restore(step, model, optimizer, scheduler) # from RAM, or None: read the disk

``SyncSaver`` writes the live state during the step (``CheckpointStore.save``) and has nothing
in flight; ``staged.StagedSaves`` copies it to host memory and writes it in the background, and
keeps the copy as the in-memory rollback target. The watchdog commits each ``Outcome`` the same
way whichever saver made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .async_save import Outcome
from .checkpoint import CheckpointStore
from .snapshot import Restored


@dataclass(frozen=True)
class Saved:
    """What ``Saver.save`` did on the step."""

    stall_seconds: float
    """How long the step was held: the whole write (synchronous) or the staging copy."""
    committed: Outcome | None = None
    """This save, already written and committed (synchronous); None: in flight."""
    earlier: Outcome | None = None
    """A background save still in flight when this one was due, which had to end first."""


class Saver(Protocol):
    """Writes healthy checkpoints of one rank; every method is called on every rank alike."""

    @property
    def in_flight(self) -> bool:
        """A save was started and not settled yet (the same on every rank)."""

    @property
    def pending_step(self) -> int | None:
        """The step of the save in flight (None: none)."""

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        extra: dict[str, Any],
        rank_state: dict[str, Any] | None,
    ) -> Saved:
        """Save ``step``; collective. Raises CheckpointError when a synchronous write failed."""

    def flags(self) -> list[float]:
        """``[done, failed]`` of this rank's write in flight, for the step's SUM reduction."""

    def settle(self, reduced: list[float], world_size: int) -> Outcome | None:
        """The outcome of the save in flight once every rank's write ended, else None."""

    def wait(self, timeout: float | None = None) -> Outcome | None:
        """End the save in flight (every rank at the same step); None if none or timed out."""

    def restore(
        self, step: int, model: torch.nn.Module, optimizer: Any, scheduler: Any
    ) -> Restored | None:
        """Restore ``step`` from memory if held, else None (the caller reads the disk)."""


class SyncSaver:
    """Each save writes the live state and commits it before the step goes on.

    Args:
        store: the checkpoint store.
    """

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store

    @property
    def in_flight(self) -> bool:
        return False

    @property
    def pending_step(self) -> int | None:
        return None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        extra: dict[str, Any],
        rank_state: dict[str, Any] | None,
    ) -> Saved:
        path = self.store.save(
            step, model, optimizer, scheduler, extra=extra, rank_state=rank_state
        )
        seconds = self.store.last_save_seconds
        if seconds is None:  # every save that returns sets it
            raise RuntimeError("the checkpoint store returned from a save it did not time")
        return Saved(stall_seconds=seconds, committed=Outcome(step, True, str(path), None, seconds))

    def flags(self) -> list[float]:
        return [0.0, 0.0]

    def settle(self, reduced: list[float], world_size: int) -> Outcome | None:
        return None

    def wait(self, timeout: float | None = None) -> Outcome | None:
        return None

    def restore(
        self, step: int, model: torch.nn.Module, optimizer: Any, scheduler: Any
    ) -> Restored | None:
        return None
