"""Checkpoint scenarios run on every rank of a spawned gloo world (see test_checkpoint_distributed).

Each compares whole tensors (all-gathered from FSDP2 shards) and returns plain data for the
parent to assert on across ranks.
"""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator
from typing import Any

import torch
from support.models import TINY, TinyGPT, random_batches
from support.reference import full
from support.world import wrap

from torchvitals.agent.recover import shards
from torchvitals.agent.recover.checkpoint import CheckpointError, CheckpointStore


def _setup(kind: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    model = wrap(kind, model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    return model, opt, sched


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, batches: list) -> None:
    for x, y in batches:
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    """Whole tensors of the model and optimizer state (a collective under FSDP2)."""
    params = opt.param_groups[0]["params"]
    return {
        "model": {n: full(p.detach()).clone() for n, p in model.named_parameters()},
        "optim": [{k: full(v).clone() for k, v in opt.state[p].items()} for p in params],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "sched": sched.state_dict(),
    }


def same(a: Any, b: Any) -> bool:
    """Exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def save_train_load(rank: int, world: int, kind: str, root: str) -> dict[str, Any]:
    """Save at step 2, train 3 steps, load: the saved state is back, and replaying the 3 steps
    lands on the same weights as the first time."""
    model, opt, sched = _setup(kind, world)
    batches = list(
        random_batches(5, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank)
    )
    _train(model, opt, sched, batches[:2])
    store = CheckpointStore(root, keep=2)
    torch.manual_seed(100 + rank)  # each rank's RNG differs; each must get its own back
    rng = torch.get_rng_state()
    path = store.save(2, model, opt, sched, extra={"position": 2, "rank_that_saved": rank})
    saved = _state(model, opt, sched)
    _train(model, opt, sched, batches[2:])
    first_run = _state(model, opt, sched)
    changed = not same(saved["model"], first_run["model"]) and not same(
        saved["optim"], first_run["optim"]
    )
    torch.manual_seed(7)
    restored = store.load(model, opt, sched)
    after_load = _state(model, opt, sched)
    rng_back = torch.equal(torch.get_rng_state(), rng)
    _train(model, opt, sched, batches[2:])
    return {
        "path": str(path),
        "restored_path": str(restored.path),
        "step": restored.step,
        "extra": restored.extra,
        "changed_by_training": changed,
        "state_restored": same(saved, after_load),
        "rng_restored": rng_back,
        "replay_equal": same(first_run, _state(model, opt, sched)),
        "seconds": store.last_save_seconds,
    }


def fail_on_rank1(rank: int, world: int, kind: str, root: str) -> dict[str, Any]:
    """Rank 1 alone cannot write files past a size limit (RLIMIT_FSIZE: EFBIG, as a full disk
    gives ENOSPC; it stops root too). Two saves fail, at the RNG files and inside DCP's shard
    writes; a third fails at rank 1's non-tensor state, and a load fails reading it back; both
    ranks must raise each time, and step 1's checkpoint must stay the one that loads."""
    model, opt, sched = _setup(kind, world)
    batches = list(
        random_batches(3, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank)
    )
    store = CheckpointStore(root)
    _train(model, opt, sched, batches[:1])
    store.save(1, model, opt, sched)
    saved = _state(model, opt, sched)
    _train(model, opt, sched, batches[1:])
    errors = []
    # 1 kB stops the RNG file (~20 kB); 40 kB lets it through and stops the shards (~270 kB).
    for limit in (1_000, 40_000):
        errors.append(_save_limited(store, rank, limit, model, opt, sched))
    # Rank 1 alone fails between the RNG files and DCP's shards: at its non-tensor state, on
    # the way out and on the way back in. The other rank must not go on into DCP's plan
    # exchange without it (that hung both ranks until the group's timeout).
    with _failing_on_rank1(rank, shards, "write_json", OSError(28, "No space left on device")):
        errors.append(_save_limited(store, rank, 1 << 30, model, opt, sched))
    with _failing_on_rank1(rank, shards.json, "loads", ValueError("not JSON")):
        try:
            store.load(model, opt, sched)
            errors.append(None)
        except CheckpointError as e:
            errors.append(str(e))
    leftovers = sorted(p.name for p in store.root.iterdir())
    restored = store.load(model, opt, sched)
    return {
        "errors": errors,
        "leftovers": leftovers,
        "step": restored.step,
        "state_restored": same(saved, _state(model, opt, sched)),
    }


@contextlib.contextmanager
def _failing_on_rank1(rank: int, owner: Any, name: str, error: Exception) -> Iterator[None]:
    """On rank 1, ``owner.name`` raises ``error`` inside the block; rank 0 is untouched."""
    real = getattr(owner, name)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    if rank == 1:
        setattr(owner, name, fail)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _save_limited(store: CheckpointStore, rank: int, limit: int, *state: Any) -> str | None:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.getsignal(signal.SIGXFSZ)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        store.save(2, *state)
        return None
    except CheckpointError as e:
        return str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
