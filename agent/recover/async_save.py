"""Healthy checkpoints written in the background, committed when every rank's write succeeded.

    saver = BackgroundSaver(store)                 # store over its own gloo group (groups.py)
    saver.start(snapshot)                          # after ``snapshot.stage``: returns at once
    packer.add_host_sum("checkpoint", saver.flags())       # every step, in the step's SUM
    outcome = saver.settle(reduced_flags, world_size)      # same step, same answer on every rank

The write thread runs the whole ``CheckpointStore.save`` of the staged copy: rank files, DCP
shards, hashes, manifest and the atomic rename, each phase agreed over the checkpoint group, so
the rename happens only once every rank's write succeeded and a failure is raised in every rank's
thread alike. What remains is to tell every *training* thread in the same step: each rank adds
``[done, failed]`` of its own thread to the step's SUM reduction (no extra collective), and the
first step whose sum says every rank is done settles the save on every rank at once.

Why a separate group: the write's collectives (DCP's plan exchange, the phase agreements) run
while the training thread issues its own; two threads on one process group interleave their
collectives differently on different ranks and hang. torch's own ``dcp.async_save`` runs only
DCP's part in its thread, not our manifest and rename, hence this thread of our own.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass

from .agreement import CheckpointError
from .checkpoint import CheckpointStore
from .snapshot import Snapshot

log = logging.getLogger(__name__)

_writers: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def writing() -> bool:
    """Whether a background write of this process is still running (e.g. past ``close``'s wait)."""
    return any(t.is_alive() for t in list(_writers))


@dataclass
class Outcome:
    """How a checkpoint save ended, identical on every rank."""

    step: int
    ok: bool
    path: str | None
    error: str | None
    write_seconds: float
    snapshot: Snapshot | None = None
    """The staged copy that was written (None: a synchronous save of the live state)."""
    agreed: bool = True
    """Every rank's phases reached this outcome. False: one of the write's own collectives
    failed (a peer died mid-save), so this rank alone may know of it."""


class BackgroundSaver:
    """At most one checkpoint write in flight, in a daemon thread of this rank."""

    def __init__(self, store: CheckpointStore):
        self.store = store
        self.pending: Snapshot | None = None
        self._thread: threading.Thread | None = None
        self._result: tuple[bool, str | None, str | None, float, bool] | None = None

    @property
    def in_flight(self) -> bool:
        """A save was started and not settled yet (the same on every rank)."""
        return self.pending is not None

    @property
    def pending_step(self) -> int | None:
        """The step of the save in flight (None: none)."""
        return None if self.pending is None else self.pending.step

    def start(self, snap: Snapshot) -> None:
        """Write ``snap`` in the background; collective in the write thread."""
        if self.pending is not None:
            raise RuntimeError("a checkpoint write is already in flight")
        self.pending, self._result = snap, None
        self._thread = threading.Thread(
            target=self._write,
            args=(snap,),
            daemon=True,
            name=f"torchvitals-checkpoint-{snap.step}",
        )
        _writers.add(self._thread)
        self._thread.start()

    def _write(self, snap: Snapshot) -> None:
        start = time.perf_counter()
        try:
            path = self.store.save(snap.step, staged=snap)
            self._result = (True, str(path), None, time.perf_counter() - start, True)
        except BaseException as e:
            # The store raises CheckpointError on every rank alike once its phases agreed; any
            # other error is a collective of the write that failed (a peer gone mid-save).
            agreed = isinstance(e, CheckpointError)
            error = f"{type(e).__name__}: {e}"
            self._result = (False, None, error, time.perf_counter() - start, agreed)

    def flags(self) -> list[float]:
        """``[done, failed]`` of this rank's write, for the step's SUM reduction."""
        result = self._result
        if self.pending is None or result is None:
            return [0.0, 0.0]
        return [1.0, 0.0 if result[0] else 1.0]

    def settle(self, reduced: list[float], world_size: int) -> Outcome | None:
        """The save's outcome once the reduced flags say every rank is done, else None.

        Args:
            reduced: the SUM over the ranks of ``flags()``.
            world_size: ranks in the reduction.
        """
        if self.pending is None or reduced[0] < world_size:
            return None
        outcome = self.wait()
        if outcome is None:  # the wait blocks until the write ends
            raise RuntimeError("the checkpoint write in flight ended without an outcome")
        if outcome.ok and reduced[1] > 0:  # cannot happen: the phases agree; be safe
            log.error(
                "torchvitals: checkpoint of step %d committed here but failed on %d "
                "rank(s); not trusting it",
                outcome.step,
                int(reduced[1]),
            )
            outcome.ok, outcome.error = False, f"failed on {int(reduced[1])} rank(s)"
        return outcome

    def wait(self, timeout: float | None = None) -> Outcome | None:
        """Block until this rank's write ends and take its outcome (None: timed out).

        Every rank's thread reached the same verdict (the phases agree over the checkpoint
        group), so ranks that wait at the same step settle alike without a message.
        """
        if self.pending is None or self._thread is None:  # set together by ``start``
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        if self._result is None:  # ``_write`` sets it whatever happens
            raise RuntimeError("the checkpoint write thread ended without a result")
        ok, path, error, seconds, agreed = self._result
        outcome = Outcome(
            self.pending.step, ok, path, error, seconds, snapshot=self.pending, agreed=agreed
        )
        self.pending, self._thread, self._result = None, None, None
        return outcome
