"""Watchdog scenarios run on every rank of a spawned gloo world (see test_recovery.py).

Every scenario trains a small TinyGPT through ``agent.batches(...)`` and ``agent.step(...)``
with the watchdog on (``checkpoint_dir=...``) and returns plain data for the parent to assert on.
Each batch is ``(batch_id, inputs, targets)``: the id is the batch's index in the rank's own
data, so the parent can tell exactly which batches trained the model.

Faults are injected from the rank functions themselves: a NaN in rank 1's loss, a learning rate
multiplied by 50 through the param groups, a loss multiplied by 100, and SIGKILL of the process
at a chosen moment of a checkpoint write (by wrapping ``dcp.save`` or ``os.rename`` in the rank
process). ``support.world.spawn_job`` runs worlds that are expected to die.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support.models import TINY, TinyGPT, random_batches
from support.reference import full
from support.world import restore_state, snapshot_state, wrap

import torchvitals

PER_RANK = 8  # samples per rank per batch
BASE_LR = 1e-2
WATCH = dict(
    checkpoint_every=10,
    checkpoint_keep=3,
    healthy_window=3,
    lr_backoff=0.5,
    skip_margin=3,
    max_rollbacks=3,
    rollback_window=200,
    abort_exit_code=75,
    metrics_port=0,
    log_dir="",
)
"""The watchdog settings of every scenario (a test may override some)."""

RECOVERY_METRICS = (
    "torchvitals_rollbacks_total",
    "torchvitals_last_healthy_step",
    "torchvitals_lr_scale",
    "torchvitals_skipped_batches_total",
    "torchvitals_checkpoint_seconds",
)


def lr_lambda(epoch: int) -> float:
    """The LambdaLR schedule of the scenarios that use one (a plain function: JSON-able state)."""
    return 1.0 / (1.0 + 0.02 * epoch)


def dims(kind: str) -> dict[str, int]:
    return dict(TINY, vocab=65) if kind == "fsdp" else dict(TINY)  # 65: uneven FSDP2 shards


def build(kind: str, world: int, scheduler: bool = True) -> tuple[torch.nn.Module, Any, Any]:
    """The same initial model on every rank, wrapped for DDP or FSDP2, with AdamW (+ LambdaLR)."""
    torch.manual_seed(0)
    model = TinyGPT(**dims(kind))
    model = wrap(kind, model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if scheduler else None
    return model, opt, sched


def dataset(kind: str, n: int, rank: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """This rank's ``n`` batches, ``(batch_id, inputs, targets)``; each rank's data differs."""
    d = dims(kind)
    return [
        (i, x, y)
        for i, (x, y) in enumerate(
            random_batches(n, batch=PER_RANK, seq_len=d["seq_len"], vocab=d["vocab"], seed=rank)
        )
    ]


def forward_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The LM loss with one input position masked at random (the global torch RNG), so the
    trajectory after a rollback or a restart also depends on the RNG state being restored."""
    x = x.clone()
    x[:, torch.randint(0, x.shape[1], ())] = 0
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def eval_loss(model: torch.nn.Module, kind: str) -> float:
    """Mean loss on fixed held-out batches (the same on every rank; no RNG drawn)."""
    d = dims(kind)
    total = 0.0
    with torch.no_grad():
        batches = list(random_batches(4, batch=16, seq_len=d["seq_len"], vocab=d["vocab"], seed=99))
        for x, y in batches:
            logits = model(x)
            total += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
                )
            )
    return total / len(batches)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters (all-gathered under FSDP2: call on every rank)."""
    return {
        n.removeprefix("module."): full(p.detach()).clone() for n, p in model.named_parameters()
    }


def compare(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> dict[str, float]:
    """name -> max abs difference, for every parameter not close (empty: all close)."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    return {
        n: float((actual[n] - expected[n]).abs().max())
        for n in actual
        if not torch.allclose(actual[n], expected[n], rtol=rtol, atol=atol)
    }


def describe(report: Any) -> dict[str, Any]:
    """The parts of a report the tests look at, as plain data."""
    rollback = report.rollback.to_dict() if report.rollback is not None else None
    return {
        "step": report.step,
        "action": report.action,
        "loss": report.loss,
        "rollback": rollback,
        "checkpointed": report.checkpoint.saved,
        "committed": report.checkpoint.committed,
        "failed": report.checkpoint.failed,
        "verdicts": [(v.pattern, v.severity) for v in report.verdicts],
    }


def ranges(value: Any) -> list[list[int]]:
    """A skip list as ``[[start, stop], ...]`` whatever the sequence types."""
    return [[int(a), int(b)] for a, b in (value or [])]


def metric_values(registry: Any) -> dict[str, float]:
    """Sample name -> value of the recovery metrics in ``registry`` (unlabelled by block)."""
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name in RECOVERY_METRICS:
                out[s.name] = s.value
    return out


def read_ledger(root: str) -> dict[str, Any] | None:
    path = Path(root) / "ledger.json"
    return json.loads(path.read_text()) if path.exists() else None


# ---------------------------------------------------------------- 1. NaN on rank 1 at step 30


def nan_on_rank1(rank: int, world: int, kind: str, root: str) -> dict[str, Any]:
    """50 batches; rank 1's loss is NaN at step 30 (once). Expected: both ranks roll back from
    step 30 to the checkpoint of step 20, skip batches [20, 33) (margin 3) with the LR halved,
    and train on to step 37. The final model is compared here with a reference that restores an
    in-memory copy of step 20's state (taken when step 20 was checkpointed) and trains batches
    33..49 at half the scheduled LR, without the agent."""
    from prometheus_client import CollectorRegistry

    n = 50
    data = dataset(kind, n, rank)
    model, opt, sched = build(kind, world)
    torch.manual_seed(1000 + rank)  # each rank's own RNG stream, restored on rollback
    registry = CollectorRegistry()
    agent = torchvitals.watch(model, opt, sched, checkpoint_dir=root, registry=registry, **WATCH)
    out: dict[str, Any] = {
        "resumed_from": agent.resumed_from,
        "reports": [],
        "ids": [],
        "positions": [],
    }
    snap20 = params20 = None
    injected = False
    for batch_id, x, y in agent.batches(data):
        step = agent.step_count + 1
        out["ids"].append(batch_id)
        loss = forward_loss(model, x, y)
        if rank == 1 and step == 30 and not injected:
            injected = True
            loss = loss * float("nan")
        loss.backward()
        report = agent.step(loss)
        opt.zero_grad(set_to_none=True)
        out["reports"].append(describe(report))
        out["positions"].append(agent.data_position)
        if report.step == 20 and report.action == "step" and snap20 is None:
            snap20 = snapshot_state(model, opt)
            params20 = params(model)
        if report.action == "rollback":
            out["after_rollback"] = {
                "step_count": agent.step_count,
                "lr_scale": agent.lr_scale,
                "lr": agent.lr[0],
                "skipped": ranges(agent.skipped_batches),
                "metrics": metric_values(registry) if rank == 0 else None,
                "ledger": read_ledger(root) if rank == 0 else None,
            }
    out.update(
        final_step=agent.step_count,
        lr_scale=agent.lr_scale,
        skipped=ranges(agent.skipped_batches),
        data_position=agent.data_position,
        final_metrics=metric_values(registry) if rank == 0 else None,
    )
    final = params(model)
    agent.close()

    # The reference: step 20's state, then batches 33..49 as steps 21..37 at lr x 0.5.
    out["reference_ran"] = snap20 is not None
    if snap20 is not None:
        ref, ref_opt, _ = build(kind, world, scheduler=False)
        restore_state(ref, ref_opt, snap20)
        for step, (_, x, y) in enumerate(data[33:], start=21):
            for group in ref_opt.param_groups:
                group["lr"] = BASE_LR * lr_lambda(step - 1) * 0.5
            loss = forward_loss(ref, x, y)
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        out["mismatch"] = compare(final, params(ref))
        out["moved_since_20"] = bool(compare(final, params20))
    return out


# ---------------------------------------------------------------- 2. LR x 50 at step 40


def lr_times_50(rank: int, world: int, kind: str, root: str) -> dict[str, Any]:
    """100 batches, no scheduler; right after step 40 (and its checkpoint) the test multiplies
    every param group's LR by 50. The loss spike must be caught and rolled back to step 40;
    the final held-out loss is compared with a clean run over the same 100 batches and with the
    same fault left unrecovered (which must be far off, or the scenario proves nothing)."""
    n = 100
    data = dataset(kind, n, rank)
    model, opt, _ = build(kind, world, scheduler=False)
    torch.manual_seed(1000 + rank)
    agent = torchvitals.watch(model, opt, checkpoint_dir=root, **WATCH)
    out: dict[str, Any] = {"reports": []}
    raised = False
    for _batch_id, x, y in agent.batches(data):
        loss = forward_loss(model, x, y)
        loss.backward()
        report = agent.step(loss)
        opt.zero_grad(set_to_none=True)
        out["reports"].append(describe(report))
        if report.step == 40 and report.action == "step" and not raised:
            raised = True
            for group in opt.param_groups:
                group["lr"] *= 50
    out.update(
        final_step=agent.step_count,
        lr_scale=agent.lr_scale,
        lr=agent.lr[0],
        skipped=ranges(agent.skipped_batches),
        final_loss=eval_loss(model, kind),
    )
    agent.close()
    out["clean_loss"] = _plain_run(kind, world, data, lr_x50_after=None)
    out["unrecovered_loss"] = _plain_run(kind, world, data, lr_x50_after=40)
    return out


def _plain_run(kind: str, world: int, data: list, lr_x50_after: int | None) -> float:
    """Every batch, no agent; the LR x 50 after step ``lr_x50_after`` when given."""
    model, opt, _ = build(kind, world, scheduler=False)
    torch.manual_seed(1000 + dist.get_rank())
    for step, (_, x, y) in enumerate(data, start=1):
        loss = forward_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == lr_x50_after:
            for group in opt.param_groups:
                group["lr"] *= 50
    value = eval_loss(model, kind)
    return value if math.isfinite(value) else float("inf")


# -------------------------------------------------------- 3. SIGKILL during a checkpoint write

KILL_POINTS = ("before_commit", "during_commit", "after_commit")


def killable_run(
    rank: int,
    world: int,
    kind: str,
    root: str,
    log_dir: str,
    run: str,
    kill: tuple[str, int] | None,
) -> dict[str, Any]:
    """One launch of the job: 60 batches, rank 1's loss NaN at step 25 (once per job: a marker
    file), so the ledger holds a rollback (to 20, skipping [20, 28)) before any kill.

    ``kill = (point, step)`` SIGKILLs rank 0 while the checkpoint of ``step`` is written:
    ``before_commit`` once DCP has written the shards into the temporary folder (no manifest,
    no rename); ``during_commit`` at the rename of the complete temporary folder into place,
    before it happens; ``after_commit`` right after that rename returned (the ledger does not
    know the checkpoint yet). The parent then SIGKILLs the rest of the world.

    Every consumed batch is appended to ``<log_dir>/rank<r>.jsonl`` as it is taken (a killed
    process loses nothing), with the step it trains, so the parent can rebuild which batch
    trained each step of the final model."""
    n = 60
    data = dataset(kind, n, rank)
    log = os.open(
        os.path.join(log_dir, f"rank{rank}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND
    )

    def write(entry: dict[str, Any]) -> None:
        os.write(log, (json.dumps({"run": run, **entry}) + "\n").encode())

    if kill is not None and rank == 0:
        _arm_kill(*kill, write)
    model, opt, sched = build(kind, world)
    torch.manual_seed(1000 + rank)
    # Each launch is a restart of the same job (by hand here, not through a supervisor).
    agent = torchvitals.watch(model, opt, sched, checkpoint_dir=root, resume="auto", **WATCH)
    write(
        {
            "event": "start",
            "resumed_from": agent.resumed_from,
            "step_count": agent.step_count,
            "data_position": agent.data_position,
            "lr_scale": agent.lr_scale,
            "lr": agent.lr[0],
            "skipped": ranges(agent.skipped_batches),
        }
    )
    marker = Path(log_dir) / f"nan-injected-rank{rank}"
    for batch_id, x, y in agent.batches(data):
        step = agent.step_count + 1
        if kill is not None and rank == 0 and step == kill[1] + 1:
            # The kill comes from the background write of step kill[1]. Rank 0's training
            # waits for it here, so rank 1 cannot finish the epoch (a kill after the commit of
            # step 50 leaves two steps) while the write is still going on a loaded machine.
            threading.Event().wait(timeout=120)
        write({"event": "batch", "step": step, "id": batch_id})
        loss = forward_loss(model, x, y)
        if rank == 1 and step == 25 and not marker.exists():
            marker.touch()
            loss = loss * float("nan")
        loss.backward()
        report = agent.step(loss)
        opt.zero_grad(set_to_none=True)
        write({"event": "report", **describe(report), "step_count": agent.step_count})
    write(
        {
            "event": "end",
            "step_count": agent.step_count,
            "lr_scale": agent.lr_scale,
            "skipped": ranges(agent.skipped_batches),
        }
    )
    final = params(model)
    agent.close()
    os.close(log)
    return {"final": final, "step_count": agent.step_count}


def _arm_kill(point: str, step: int, write: Callable[[dict[str, Any]], None]) -> None:
    """Make this process SIGKILL itself at ``point`` of the checkpoint write of ``step``."""
    import torch.distributed.checkpoint as dcp

    from torchvitals.agent.recover.checkpoint import CheckpointStore

    current = [None]
    real_save = CheckpointStore.save

    def save(self, save_step, *args, **kwargs):
        current[0] = save_step
        try:
            return real_save(self, save_step, *args, **kwargs)
        finally:
            current[0] = None

    CheckpointStore.save = save

    def die(where: str) -> None:
        write(
            {
                "event": "killed",
                "point": point,
                "step": step,
                "where": where,
                "thread": threading.current_thread().name,
            }
        )
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "before_commit":
        real_dcp_save = dcp.save

        def dcp_save(*args, **kwargs):
            result = real_dcp_save(*args, **kwargs)
            if current[0] == step:
                die("after DCP wrote the shards, before the manifest and the rename")
            return result

        dcp.save = dcp_save
    else:
        real_rename = os.rename
        target = f"step-{step:08d}"

        def rename(src, dst, *args, **kwargs):
            hit = Path(dst).name == target and Path(src).name.startswith(".tmp-step-")
            if hit and point == "during_commit":
                die(f"before renaming {Path(src).name} to {target}")
            result = real_rename(src, dst, *args, **kwargs)
            if hit and point == "after_commit":
                die(f"after renaming {Path(src).name} to {target}")
            return result

        os.rename = rename
    assert point in KILL_POINTS, point


# ---------------------------------------------------------------- 4. a spike that comes back

FAULT_STEP = {"loss_x100": 21, "nan_at_25": 25}
"""The step at which each returning fault first shows, after every rollback to step 20."""


def spike_every_time(
    rank: int, world: int, kind: str, root: str, result_dir: str, exit_code: int, fault: str
) -> dict[str, Any]:
    """120 batches and a fault that comes back after every rollback: ``loss_x100``: both ranks'
    loss is multiplied by 100 on every step past 20 (a loss spike that persists); ``nan_at_25``:
    rank 1's loss is NaN every time step 25 is reached. Expected: rollbacks that escalate (each
    repeat further back, the skips wider: hence the batches), then TrainingAborted (code
    ``exit_code``) on every rank in the same step. What the rank saw is written to
    ``<result_dir>/rank<r>.pkl`` before the exception leaves, so the process's exit code is the
    agent's."""
    data = dataset(kind, 120, rank)
    model, opt, sched = build(kind, world)
    torch.manual_seed(1000 + rank)
    agent = torchvitals.watch(
        model, opt, sched, checkpoint_dir=root, **dict(WATCH, abort_exit_code=exit_code)
    )
    out: dict[str, Any] = {"reports": [], "aborted": None}
    try:
        for _batch_id, x, y in agent.batches(data):
            step = agent.step_count + 1
            loss = forward_loss(model, x, y)
            if fault == "loss_x100" and step > 20:
                loss = loss * 100
            if fault == "nan_at_25" and step == 25 and rank == 1:
                loss = loss * float("nan")
            loss.backward()
            out["current_step"] = step
            report = agent.step(loss)
            opt.zero_grad(set_to_none=True)
            out["reports"].append(describe(report))
    except BaseException as e:
        history = getattr(getattr(agent, "detector", None), "history", [])
        out["aborted"] = {
            "type": type(e).__name__,
            "module": type(e).__module__,
            "is_training_aborted": isinstance(e, getattr(torchvitals, "TrainingAborted", ())),
            "is_system_exit": isinstance(e, SystemExit),
            "code": getattr(e, "code", None),
            "message": str(e),
            "history": [(v.pattern, v.severity, v.step) for v in history],
            "ledger": read_ledger(root) if rank == 0 else None,
        }
        raise
    finally:
        with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    return out
