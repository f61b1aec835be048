"""World-size-2 gloo harnesses for tests that spawn ranks, and the wrappers the ranks train.

    from support.world import run_world, spawn_job, free_port, wrap

``run_world`` runs a function on spawned ranks that must all succeed; ``spawn_job`` on ranks
that may die (a whole job, as under a supervisor). The ranks start from a server process that
imported torch once (``_context``) and take this process's ``sys.path``, working folder and
environment as they are when the ranks start, so the functions they run may live in any module
the test imported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from support.ports import free_port as free_port
from torchvitals.agent.measure.reduce import drain_collectives_at_exit


def wrap(kind: str, model: nn.Module, world: int) -> nn.Module:
    """DDP, or FSDP2 with every transformer block sharded separately and then the root."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# ---------------------------------------------------------------- world-size-2 harness


PRELOAD = ["torch", "torch.distributed", "torchvitals", "support.models", "support.world"]
"""What the ranks' server process imports once, before it forks every rank of every world."""


def _context(teardown: bool = False) -> Any:
    """How the ranks start: forked from a server process that imported torch and torchvitals
    once (multiprocessing's ``forkserver``), instead of each rank importing them again (about
    2 s of CPU a rank, most of a short test's). Each rank is still a fresh process of its own:
    none inherits the test process's threads, patches or gloo state, as under ``spawn``. A rank
    that must end through the interpreter's own exit (``teardown``: atexit handlers, non-daemon
    threads joined) is spawned, since a forked child leaves with ``os._exit``."""
    if teardown:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _take_environment(env: dict) -> None:
    """The test process's environment as it is now (a forked rank has its server's, from when
    the server started): what a test set before starting the ranks reaches them."""
    os.environ.clear()
    os.environ.update(env)


def _child(
    fn: Callable, rank: int, world: int, port: int, queue: Any, env: dict, args: tuple
) -> None:
    _take_environment(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    drain_collectives_at_exit()  # a reference run without the agent exits as cleanly
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        try:
            result = fn(rank, world, *args)
            queue.put((rank, "ok", result))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_world(fn: Callable, *args: Any, world: int = 2, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; return results by rank.

    A rank that raises, exits non-zero or hangs past ``timeout`` fails the calling test.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, port, queue, env, args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except Exception:  # queue.Empty
                raise AssertionError(
                    f"ranks {sorted(set(range(world)) - set(results))} hung "
                    f"(no result within {timeout}s)"
                ) from None
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise AssertionError("\n".join(errors))
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}"
    return [results[r] for r in range(world)]


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def snapshot_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """An in-memory copy of what a healthy checkpoint holds: model, optimizer, this rank's RNG."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": _clone(model_sd), "optim": _clone(optim_sd), "rng": torch.get_rng_state()}


def restore_state(model: torch.nn.Module, opt: torch.optim.Optimizer, snap: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        model, opt, model_state_dict=_clone(snap["model"]), optim_state_dict=_clone(snap["optim"])
    )
    torch.set_rng_state(snap["rng"])


# ---------------------------------------------------------------- a world that may die


def _job_child(
    fn: Callable,
    rank: int,
    world: int,
    port: int,
    result_dir: str,
    teardown: bool,
    env: dict,
    args: tuple,
) -> None:
    _take_environment(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    path = os.path.join(result_dir, f"result-{rank}.pkl")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
        try:
            value = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        _write_result(path, ("ok", value))
        code = 0
    except BaseException as exc:  # the parent reads it; the exit code is the exception's
        _write_result(path, ("raised", traceback.format_exc()))
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    if teardown:  # the interpreter's own exit: non-daemon threads joined, atexit handlers run
        sys.exit(code)
    # Leave without interpreter teardown: destroying a DDP/gloo rank's C++ objects after its peer
    # left sometimes ends in std::terminate (SIGABRT), which would hide the exit code under test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _write_result(path: str, result: tuple) -> None:
    """Write-then-rename: the parent may SIGKILL this rank mid-write when its peer dies."""
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)


def spawn_job(
    fn: Callable,
    *args: Any,
    world: int = 2,
    timeout: float = 90.0,
    grace: float = 15.0,
    wait_for: Collection[int] | None = None,
    teardown: bool = False,
) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks that may die.

    A rank killed by a signal makes the parent SIGKILL every other rank at once (the whole job
    dies, as under a supervisor); a rank that exits non-zero leaves the others ``grace``
    seconds to exit on their own (an abort reaches every rank in the same step); past
    ``timeout`` every rank still alive is killed and reported as hung.

    Args:
        wait_for: the ranks the job is about (default: every rank). A rank outside it that dies
            or stops is the test's own fault, which ends nothing: once every rank of
            ``wait_for`` exited, the others still alive are killed.
        teardown: each rank ends through the interpreter's own exit (non-daemon threads
            joined, atexit handlers run) instead of ``os._exit``: for tests of what may hold a
            process at exit.

    Returns:
        Per rank: ``{"exitcode", "status" ("ok", "raised" or None), "value" or "traceback",
        "hung", "killed_by_parent"}``.
    """
    ctx = _context(teardown)
    port = free_port()
    result_dir = tempfile.mkdtemp(prefix="tv-job-")
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_job_child, args=(fn, r, world, port, result_dir, teardown, env, args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    watched = set(range(world) if wait_for is None else wait_for)
    deadline = time.monotonic() + timeout
    killed_by_parent: set[int] = set()
    hung: set[int] = set()
    first_failure: float | None = None
    try:
        while any(procs[r].is_alive() for r in watched):
            now = time.monotonic()
            codes = [p.exitcode if r in watched else None for r, p in enumerate(procs)]
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            if any(c is not None and c > 0 for c in codes) and first_failure is None:
                first_failure = now
            doomed: list[int] = []
            if now > deadline:
                hung.update(r for r in alive if r in watched)
                doomed = alive
            elif any(c is not None and c < 0 for c in codes) or (
                first_failure is not None and now - first_failure > grace
            ):
                doomed = alive
            for r in doomed:
                killed_by_parent.add(r)
                procs[r].kill()
            time.sleep(0.02)
        for r, p in enumerate(procs):  # the ones left out of ``wait_for``
            if p.is_alive():
                killed_by_parent.add(r)
                p.kill()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    out = []
    for r, p in enumerate(procs):
        entry: dict[str, Any] = {
            "exitcode": p.exitcode,
            "status": None,
            "hung": r in hung,
            "killed_by_parent": r in killed_by_parent,
        }
        path = os.path.join(result_dir, f"result-{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                status, payload = pickle.load(f)
            entry["status"] = status
            entry["value" if status == "ok" else "traceback"] = payload
        out.append(entry)
    return out
