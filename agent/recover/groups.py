"""The background writes' gloo groups: made once per process and set of ranks, then reused.

    group = checkpoint_group(parent)    # the process's first agent creates it; later ones reuse it

A background checkpoint write runs its collectives in its own thread, so it needs a process
group of its own (see ``async_save``). Creating one per agent and destroying it at ``close()``
hung: ``dist.new_group(ranks, use_local_synchronization=True)`` names a group after its ranks
and the number of groups alive, so the group of the next agent over the same ranks gets the
name of the one just destroyed, and its gloo rendezvous reads the dead group's addresses,
still in the store under that name. Whether a rank read a stale address or its peer's new one
was a race: six ``watch()``/``close()`` cycles on two ranks hung in most tries.

So each process keeps one group per set of ranks for its lifetime: the first ``watch()`` creates
it (every rank of the parent group at the same call), every later agent over the same ranks
reuses it without a collective, and it goes away only with every rank at once: when the
default group is destroyed (``dist.destroy_process_group()`` shuts down every group), or at
process exit.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

from .async_save import writing

log = logging.getLogger(__name__)


class CheckpointGroups:
    """This process's background-write groups, one per set of global ranks.

    Args:
        busy: whether a checkpoint write may still be using a group (then ``close`` leaves it
            to the interpreter rather than pulling it from under the write).
    """

    def __init__(self, busy: Callable[[], bool] = lambda: False) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._lock = threading.Lock()
        self._busy = busy
        self._exit_registered = False

    def get(self, parent: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The gloo group over ``parent``'s ranks; collective only when it has to be made.

        Args:
            parent: the agent's group (None: the default group).

        Returns:
            The group, or None when not distributed (a single process needs none).
        """
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        ranks = tuple(range(world) if parent is None else dist.get_process_group_ranks(parent))
        with self._lock:
            group = self._groups.get(ranks)
            if group is not None and _alive(group):
                return group
            if len(ranks) == world:
                # Every rank takes part: named by the process's group counter, never reused.
                group = dist.new_group(None, backend="gloo")
            else:
                # Only the subgroup's ranks take part (the others may be making their own).
                group = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
            self._groups[ranks] = group
            if not self._exit_registered:
                atexit.register(self.close)
                self._exit_registered = True
            return group

    def close(self) -> None:
        """Destroy every group still alive; at process exit, when each rank is done with it."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        if self._busy():
            log.warning(
                "torchvitals: a checkpoint write is still in flight at exit; its group "
                "is left to the interpreter"
            )
            return
        for group in groups:
            if _alive(group):
                dist.destroy_process_group(group)


def _alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered (``destroy_process_group()`` drops every group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):
        return False
    return True


CHECKPOINT_GROUPS = CheckpointGroups(busy=writing)
"""The process's own: every agent of the process shares it."""


def checkpoint_group(parent: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The process's gloo group over ``parent``'s ranks for background writes (see the module)."""
    return CHECKPOINT_GROUPS.get(parent)
