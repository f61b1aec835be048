"""How the ranks of a checkpoint operation agree: every rank's outcome gathered, rank 0's answer
broadcast, and the error they all raise alike.

    ranks = Ranks(group)
    results = ranks.gather(fn)              # (True, fn()) or (False, why) of every rank, on each
    if errors := failures(results):         # "ranks 0, 1: <why>; rank 3: <other why>"
        raise CheckpointError(errors)
    names = ranks.on_leader(fn, folder)     # fn() on rank 0, its result (or its error) on each

A save, load or probe is collective: each of its phases runs on every rank and fails on every
rank alike, so no rank goes on into a collective the others skip (they would wait there until
the process group's timeout). Without a process group (a single process) each is a plain call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...errors import TorchvitalsError


class CheckpointError(TorchvitalsError, RuntimeError):
    """A checkpoint could not be written on some rank, or was refused on load."""


class Ranks:
    """The ranks of one process group, as a collective checkpoint operation sees them.

    Args:
        group: the process group; None is the default group (or a single process).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.distributed else 0

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group) if self.distributed else 1

    def gather(self, fn: Callable[[], Any]) -> list[tuple[bool, Any]]:
        """Run ``fn`` on this rank; collective.

        Args:
            fn: this rank's part.

        Returns:
            ``(True, fn())`` or ``(False, the error)`` of every rank, in rank order, on every rank.
        """
        try:
            mine: tuple[bool, Any] = (True, fn())
        except (Exception, dcp.CheckpointException) as e:  # every rank must hear of it
            mine = (False, describe(e))
        if not self.distributed:
            return [mine]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, mine, group=self.group)
        return out

    def on_leader(self, fn: Callable[[], Any], where: str | os.PathLike) -> Any:
        """Run ``fn`` on rank 0 alone; collective.

        Args:
            fn: rank 0's part.
            where: the folder it works on, for the error.

        Returns:
            Rank 0's ``fn()``, on every rank.

        Raises:
            CheckpointError: on every rank, when ``fn`` raised on rank 0.
        """
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = (True, fn())
            except Exception as e:
                box[0] = (False, describe(e))
        if self.distributed:
            dist.broadcast_object_list(box, group=self.group, group_src=0)
        ok, value = box[0]
        if not ok:
            raise CheckpointError(f"rank 0 failed on {where}: {value}")
        return value


def failures(results: list[tuple[bool, Any]]) -> str:
    """``"ranks 0, 1: <error>; rank 3: <other error>"`` from ``Ranks.gather``'s results, or
    ``""``."""
    ranks: dict[str, list[str]] = {}
    for rank, (ok, value) in enumerate(results):
        if not ok:
            ranks.setdefault(value, []).append(str(rank))
    return "; ".join(
        f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {error}" for error, r in ranks.items()
    )


def describe(e: BaseException) -> str:
    """One line for an error: DCP's per-rank failures each named, a ``CheckpointError`` as it
    reads, anything else with its type."""
    if isinstance(e, dcp.CheckpointException):  # one (exception, traceback) per failed rank
        return "; ".join(
            f"DCP on rank {r}: {describe(exc)}" for r, (exc, _) in sorted(e.failures.items())
        )
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {str(e).strip()}"
