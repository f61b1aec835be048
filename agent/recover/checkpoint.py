"""Healthy checkpoints: ``torch.distributed.checkpoint`` shards plus JSON state, committed
atomically.

    store = CheckpointStore("checkpoints", keep=3)
    store.save(step, model, optimizer, scheduler, extra={"position": 1234})   # on every rank
    restored = store.load(model, optimizer, scheduler)    # a Restored: the newest that verifies

One checkpoint, ``<root>/step-00000120/``:

    .metadata, __<rank>_0.distcp   DCP's model and optimizer shards (DDP and FSDP2 alike)
    state.json                      step, world size, scheduler state, the caller's ``extra``
    rng-rank-00000.json, ...        each rank's torch / CUDA / Python / NumPy RNG states
    data-rank-00000.json, ...       each rank's own state from the caller (a stateful loader's)
    plain-rank-00000.json, ...      each rank's non-tensor model/optimizer state (lr, betas, names)
    manifest.json                   size and SHA-256 of every other file, signed, written last

A save fills ``<root>/.tmp-step-00000120`` and rank 0 renames it into place only once every rank
has succeeded, so a crash leaves at worst a ``.tmp-*`` folder that is never loaded. A load takes
only a folder the ledger recorded (``allowed``) whose manifest verifies: every file's SHA-256,
and the manifest's HMAC under the job's key (``recover/trust.py``). Loading unpickles nothing:
DCP's ``.metadata`` goes through an unpickler that builds DCP's metadata classes only, tensors
are read with ``weights_only=True``, and the non-tensor state is JSON. A folder that fails to
load (refused, foreign shapes, a DCP error) is skipped for the one before it, with a short
reason for each.

This module is the store: each save's phases, the choice of folder a load takes, pruning. Its
pieces: ``manifest.py`` (the folder's name and manifest: written, hashed between the ranks,
verified), ``shards.py`` (the model's and optimizer's state: DCP's shards and the plain JSON),
``agreement.py`` (each phase run on every rank and failed on every rank alike).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...records.durable import fsync_dir, write_json
from .agreement import CheckpointError, Ranks, describe, failures
from .manifest import COMMITTED, MANIFEST, digests, step_of, verify, write_manifest
from .rng import rng_state, set_rng_state
from .shards import jsonable, read_shards, write_shards
from .snapshot import Restored, Snapshot, live_tensors
from .trust import CheckpointKey, UntrustedCheckpoint

log = logging.getLogger(__name__)

STATE = "state.json"
# What loading one checkpoint can raise that means "this checkpoint, not the job": refused,
# unreadable or not matching the model. Every rank sees it alike, so every rank goes on to the
# previous checkpoint (or fails) together.
LOAD_FAILURES = (
    CheckpointError,
    UntrustedCheckpoint,
    dcp.CheckpointException,
    KeyError,
    ValueError,
    RuntimeError,
)
T = TypeVar("T")


class CheckpointStore:
    """The job's checkpoints under one folder, shared by every rank (a shared filesystem).

    Every method but ``list``/``latest`` is collective: call it on every rank of ``group``.
    A rank that dies inside one leaves the others waiting until the process group's timeout;
    that is the supervisor's to handle.

    Args:
        root: the folder; created on the first save.
        keep: how many complete checkpoints to keep (the oldest are removed after a save).
        group: the process group; None is the default group (or a single process).
        clock: seconds, for ``last_save_seconds``.
        key: signs the manifests rank 0 writes and verifies those it loads (only rank 0's is
            used); None signs nothing and checks no signature.
        trust_unsigned: load a folder whose manifest is unsigned or signed under another key.
        allowed: the folder names a load may take (the ledger's); None: any committed one.
        on_commit: told ``(step, final folder)`` on rank 0 just before the rename that commits
            a save (the ledger records it there: a crash after the rename leaves it recorded,
            so the allow-list never loses a committed checkpoint).
        distrusted: ``{folder name: why}`` never to be loaded (the ledger's: ``targets``);
            they do not count among the ``keep`` either.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep: int = 3,
        group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.perf_counter,
        key: CheckpointKey | None = None,
        trust_unsigned: bool = False,
        allowed: Callable[[], set[str]] | None = None,
        on_commit: Callable[[int, Path], None] | None = None,
        distrusted: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self._ranks = Ranks(group)
        self._clock = clock
        self.key, self.trust_unsigned, self._allowed = key, trust_unsigned, allowed
        self.on_commit = on_commit
        self._distrusted = distrusted
        self.last_save_seconds: float | None = None
        """Duration of the last successful save, every phase included."""

    @property
    def _group(self) -> dist.ProcessGroup | None:
        return self._ranks.group

    @property
    def _distributed(self) -> bool:
        return self._ranks.distributed

    @property
    def _rank(self) -> int:
        return self._ranks.rank

    @property
    def _world(self) -> int:
        return self._ranks.world

    def probe(self) -> None:
        """Prove the folder is one that every rank can write and that every rank shares, so an
        unusable folder (a file, read-only, another node's mount missing, a node-local disk
        mounted at the same path on each node) fails now, on every rank alike, not at the first
        save hours later; collective.

        Global rank 0 leaves a marker holding a random nonce; every rank writes (then removes)
        a file of its own and reads the marker back. A rank that does not find rank 0's nonce
        there sees another folder: the shards of one checkpoint would be scattered over the
        nodes' disks, and no rank could load what another wrote.

        Raises:
            CheckpointError: on every rank, naming the folder, what failed where, and the fix.
        """
        nonce = uuid.uuid4().hex
        marker = self.root / f".shared-{nonce}"

        def leave_marker() -> str:
            self.root.mkdir(parents=True, exist_ok=True)
            write_json(marker, {"nonce": nonce})
            return nonce

        try:
            expected = self._ranks.on_leader(leave_marker, self.root)
        except CheckpointError as e:  # on every rank alike
            raise CheckpointError(
                f"checkpoint_dir {self.root} is not a folder every rank can write: {e}"
            ) from None
        marker = self.root / f".shared-{expected}"

        def touch() -> tuple[str, bool, str]:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-rank-{self._rank:05d}-{os.getpid()}"
            with open(probe, "w") as f:
                f.write("torchvitals checks that it can write here\n")
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
            try:
                seen = json.loads(marker.read_text()).get("nonce") == expected
            except (OSError, ValueError, AttributeError):
                seen = False
            return socket.gethostname(), seen, str(self.root)

        results = self._ranks.gather(touch)
        if self._rank == 0:
            with contextlib.suppress(OSError):
                marker.unlink()
        if errors := failures(results):
            raise CheckpointError(
                f"checkpoint_dir {self.root} is not a folder every rank can write: {errors}"
            )
        # Named as rank 0 names the folder, so every rank raises the very same message.
        views = [value for _, value in results]
        blind = [(rank, host, path) for rank, (host, seen, path) in enumerate(views) if not seen]
        if blind:
            hosts = ", ".join(dict.fromkeys(host for _, host, _ in blind))
            ranks = ", ".join(str(rank) for rank, _, _ in blind)
            elsewhere = "".join(
                f"; rank {rank} names it {path}" for rank, _, path in blind if path != views[0][2]
            )
            raise CheckpointError(
                f"checkpoint_dir {views[0][2]} is not one folder shared by every rank: rank 0 "
                f"(host {views[0][0]}) left a marker in it that rank{'s' * (len(blind) > 1)} "
                f"{ranks} (host{'s' * (hosts.count(',') > 0)} {hosts}) cannot see there"
                f"{elsewhere}. A disk "
                "local to each node, mounted at the same path on every node, looks like this: "
                "each node would keep only its own ranks' shards, and a rollback or restart "
                "could not load them. Point checkpoint_dir at a filesystem every node mounts "
                "(NFS, Lustre, a cloud file share)"
            )

    def on_leader(self, fn: Callable[[], T]) -> T:
        """``fn()`` on global rank 0 alone, its result on every rank; collective. For a decision
        that reads the folder: taken once, from one view of it, so no two ranks part ways.

        Raises:
            CheckpointError: on every rank, when ``fn`` raised on rank 0.
        """
        return self._ranks.on_leader(fn, self.root)

    def gather(self, fn: Callable[[], Any]) -> list[tuple[bool, Any]]:
        """``fn()`` on every rank of the checkpoint group, each rank's outcome on every rank
        (``Ranks.gather``); collective."""
        return self._ranks.gather(fn)

    def read_on_leader(self, name: str) -> str | None:
        """The text of file ``name`` in the folder as global rank 0 reads it (None: there is no
        such file), on every rank; collective."""

        def read() -> str | None:
            path = self.root / name
            return path.read_text(encoding="utf-8") if path.exists() else None

        return self.on_leader(read)

    def record_with(
        self,
        allowed: Callable[[], set[str]] | None,
        on_commit: Callable[[int, Path], None] | None,
        distrusted: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        """Take the ledger once it is read: the arguments as in the class."""
        self._allowed, self.on_commit, self._distrusted = allowed, on_commit, distrusted

    def _distrusted_now(self) -> dict[str, str]:
        """The folders never to be loaded, ``{name: why}`` (none without a ledger)."""
        return self._distrusted() if self._distrusted is not None else {}

    def list(self) -> list[Path]:
        """Committed checkpoint folders, oldest first (not verified: ``load`` verifies)."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := COMMITTED.fullmatch(p.name)) and p.is_dir()
        ]
        return [p for _, p in sorted(found)]

    def folders(self, step: int) -> tuple[Path, Path]:
        """The temporary folder a save of ``step`` fills and the folder it is committed as."""
        name = f"step-{step:08d}"
        return self.root / f".tmp-{name}", self.root / name

    def latest(self) -> Path | None:
        """The newest committed checkpoint folder, or None."""
        folders = self.list()
        return folders[-1] if folders else None

    def save(
        self,
        step: int,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        rank_state: dict[str, Any] | None = None,
        *,
        staged: Snapshot | None = None,
    ) -> Path:
        """Write a checkpoint of ``step`` and commit it; collective.

        Args:
            step: the training step it holds (names the folder; an existing one is replaced).
            model: the model, plain, DDP or FSDP2.
            optimizer: its optimizer.
            scheduler: an LR scheduler whose ``state_dict()`` is JSON-able (the usual ones are).
            extra: JSON-able state of the caller (data position, skip list, ...); rank 0's is kept.
            rank_state: JSON-able state of this rank alone (e.g. its data loader's), kept per rank.
            staged: a host copy of all of the above (``snapshot.stage``) to write instead of the
                live objects, which are then ignored: the background write reads only this, so
                training may go on meanwhile.

        Returns:
            The committed folder.

        Raises:
            CheckpointError: on every rank, when any rank failed; earlier checkpoints are untouched.
            TypeError: neither ``staged`` nor both the model and the optimizer were given.
        """
        if staged is None and (model is None or optimizer is None):
            raise TypeError("save() needs the model and its optimizer, or a staged snapshot")
        start = self._clock()
        tmp, final = self.folders(step)
        leader = self._rank == 0
        if staged is not None:
            extra, rank_state = staged.extra, staged.rank_state
        sched_state = (
            staged.scheduler
            if staged is not None
            else (None if scheduler is None else scheduler.state_dict())
        )

        def prepare() -> None:
            if not leader:
                return
            state = {
                "step": step,
                "world_size": self._world,
                "time": time.time(),
                "scheduler": None
                if sched_state is None
                else jsonable(sched_state, "scheduler.state_dict()"),
                "extra": jsonable(extra or {}, "extra"),
            }
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-*"):  # an interrupted earlier save
                if stale.is_dir():
                    shutil.rmtree(stale)
                else:
                    stale.unlink()
            tmp.mkdir()
            write_json(tmp / STATE, state)

        def commit() -> None:
            if not leader:
                return
            fsync_dir(tmp)
            write_manifest(tmp, step, files, self.key)
            fsync_dir(tmp)
            if self.on_commit is not None:
                self.on_commit(step, final)
            replaced = self.root / f".tmp-replaced-{final.name}"
            if final.exists():  # a step saved again after a rollback: the new one wins
                os.rename(final, replaced)
            try:
                os.rename(tmp, final)
            except OSError:
                if replaced.exists():
                    os.rename(replaced, final)
                raise
            fsync_dir(self.root)
            shutil.rmtree(replaced, ignore_errors=True)

        self._agree("preparing", prepare, step, tmp)
        self._agree(
            "writing the RNG states",
            lambda: self._write_rank_files(
                tmp, rank_state, staged.rng if staged is not None else None
            ),
            step,
            tmp,
        )

        def tensors() -> dict[str, Any]:
            if staged is not None:
                return staged.tensors
            assert model is not None and optimizer is not None  # checked on entry
            return live_tensors(model, optimizer)

        self._agree(
            "writing the model and optimizer shards",
            lambda: write_shards(tmp, tensors(), self._ranks),
            step,
            tmp,
        )
        try:
            files = digests(
                tmp,
                self._ranks.on_leader(lambda: sorted(p.name for p in tmp.iterdir()), self.root),
                self._ranks,
            )
        except CheckpointError as e:
            self._fail("hashing the files", str(e), step, tmp)
        self._agree("committing", commit, step, tmp)
        if leader:
            self._prune()
        self.last_save_seconds = self._clock() - start
        return final

    def load(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        path: str | os.PathLike | None = None,
    ) -> Restored:
        """Restore model, optimizer, scheduler and this rank's RNG states in place; collective.

        Args:
            model, optimizer, scheduler: as passed to ``save`` (scheduler None: not restored).
            path: a checkpoint folder; None takes the newest that the ledger recorded, that
                verifies and that loads, warning about each newer one refused.

        Returns:
            What was restored: the step, the folder, the caller's ``extra``, this rank's
            ``rank_state`` and the newer folders ``refused`` on the way.

        Raises:
            CheckpointError: ``path`` (or, without it, every checkpoint) is refused or fails to
                load; a few lines naming each folder and why, and what to do.
        """
        if path is not None:
            candidates = [Path(path)]
        else:
            candidates = [Path(p) for p in self._ranks.on_leader(self._candidates, self.root)]
        refused: list[tuple[Path, str]] = []
        for folder in candidates:
            problem = verify(folder, self._ranks, self.root, self.key, self.trust_unsigned)
            if problem is None:
                try:
                    return self._restore(folder, model, optimizer, scheduler, refused)
                except LOAD_FAILURES as e:
                    # Every rank gets here alike: DCP raises its failures on every rank.
                    problem = f"it failed to load: {describe(e)}"
            if path is not None:
                raise CheckpointError(f"refusing checkpoint {folder}: {problem}")
            log.warning("refusing checkpoint %s: %s; trying the previous one", folder, problem)
            refused.append((folder, problem))
        reasons = "; ".join(f"{f.name}: {r}" for f, r in refused) or "none was saved"
        raise CheckpointError(
            f"no checkpoint under {self.root} verifies and loads ({reasons}).\nThe model and "
            f"optimizer may hold a partial load: restart from a checkpoint you trust (point "
            f"checkpoint_dir at it), or start afresh with a new checkpoint_dir"
        )

    def _candidates(self) -> builtins.list[str]:
        """Committed folders the ledger recorded, newest first (rank 0)."""
        for leftover in sorted(self.root.glob(".tmp-*")) if self.root.is_dir() else []:
            log.warning("ignoring %s: a save that never committed", leftover)
        allowed = self._allowed() if self._allowed is not None else None
        distrusted = self._distrusted_now()
        found = []
        for folder in reversed(self.list()):
            if allowed is not None and folder.name not in allowed:
                log.warning(
                    "ignoring %s: the ledger never recorded it (not this job's save)", folder
                )
                continue
            if folder.name in distrusted:
                log.warning("ignoring %s: distrusted (%s)", folder, distrusted[folder.name])
                continue
            found.append(str(folder))
        return found

    def _restore(
        self,
        folder: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        refused: builtins.list[tuple[Path, str]],
    ) -> Restored:
        # The folder's own state as global rank 0 reads it, and this rank's files read before
        # DCP's collective load: a file one rank alone cannot read fails every rank here, so
        # every rank goes on to the previous checkpoint together.
        state = self.on_leader(lambda: json.loads((folder / STATE).read_text()))
        if scheduler is not None and state["scheduler"] is None:
            raise CheckpointError(f"{folder} holds no scheduler state, but a scheduler was passed")
        same_world = state["world_size"] == self._world

        def rank_files() -> tuple[Any, Any]:
            rng = json.loads((folder / f"rng-rank-{self._rank:05d}.json").read_text())
            mine = folder / f"data-rank-{self._rank:05d}.json"
            return rng, json.loads(mine.read_text()) if mine.exists() else None

        read = self._ranks.gather(rank_files if same_world else lambda: (None, None))
        if errors := failures(read):
            raise CheckpointError(f"reading each rank's files: {errors}")
        rng, rank_state = read[self._rank][1]
        error: BaseException | None = None
        try:
            read_shards(folder, model, optimizer, self._ranks)
            if scheduler is not None:
                scheduler.load_state_dict(state["scheduler"])
        except LOAD_FAILURES as e:
            error = e
        # One rank's failure after DCP's load (its plain state, its scheduler) is every rank's:
        # none keeps a state the others refused.
        if errors := failures(self._ranks.gather(lambda: _reraise(error))):
            raise CheckpointError(errors) from error
        if same_world:
            set_rng_state(rng)
        else:  # DCP reshards the tensors; per-rank RNG streams have no such mapping
            log.warning(
                "%s was saved by %d ranks, now %d: RNG states not restored",
                folder,
                state["world_size"],
                self._world,
            )
        return Restored(
            step=state["step"],
            path=folder,
            extra=state["extra"],
            rank_state=rank_state,
            refused=refused,
        )

    def _write_rank_files(
        self, tmp: Path, rank_state: dict[str, Any] | None, rng: dict[str, Any] | None
    ) -> None:
        write_json(tmp / f"rng-rank-{self._rank:05d}.json", rng if rng is not None else rng_state())
        if rank_state is not None:
            write_json(tmp / f"data-rank-{self._rank:05d}.json", jsonable(rank_state, "rank_state"))

    def _agree(self, phase: str, fn: Callable[[], None], step: int, tmp: Path) -> None:
        """Run ``fn`` on every rank; if it failed anywhere, raise on every rank."""
        if errors := failures(self._ranks.gather(fn)):
            self._fail(phase, errors, step, tmp)

    def _fail(self, phase: str, why: str, step: int, tmp: Path) -> NoReturn:
        if self._rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if self._distributed:  # every rank raises only once the folder is settled
            dist.barrier(group=self._group)
        previous = self.latest()
        raise CheckpointError(
            f"saving step {step} into {tmp} failed while {phase}: {why}"
            + (f"; the previous checkpoint ({previous}) is untouched" if previous else "")
        )

    def _prune(self) -> None:
        distrusted = self._distrusted_now()
        complete = [p for p in self.list() if (p / MANIFEST).is_file() and p.name not in distrusted]
        if len(complete) <= self.keep:
            return
        oldest_kept = step_of(complete[-self.keep])
        for folder in self.list():
            if step_of(folder) < oldest_kept:
                try:
                    shutil.rmtree(folder)
                except OSError as e:
                    log.warning("could not remove old checkpoint %s: %s", folder, e)


def _reraise(error: BaseException | None) -> None:
    """For ``Ranks.gather``: this rank's outcome, an error it already met raised again."""
    if error is not None:
        raise error
