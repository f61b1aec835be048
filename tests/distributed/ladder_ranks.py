"""The ladder on every rank of a spawned gloo world (see test_ladder.py).

A new user's run: TinyGPT (residual) under DDP, AdamW with a warm-up and cosine schedule, the
watchdog on (``checkpoint_every=10``), 200 steps. A bad batch is rank 0's shard whose loss (and
so its gradients) is five times what it should be, at the batch ids given: the mean loss jumps
for one step and the next normal batch would heal it. ``fault="logits"`` is a one-step fault in
rank 1's forward instead: its logits times 1000 (a flipped exponent, a bad kernel). The rank
function returns what the parent asserts on: each step's action, verdicts and the ranks they
name, whether the weights moved across each bad step, the held-out loss at the end, and (rank 0)
the job's goodput.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from recovery_ranks import dataset, eval_loss
from support.models import TINY, TinyGPT
from support.world import wrap

import torchvitals
from torchvitals.agent.recover.watchdog import TrainingAborted
from torchvitals.records.goodput import account
from torchvitals.records.incidents import IncidentLog

STEPS = 200
WARMUP = 10
LR = 3e-3


def cosine(step: int) -> float:
    """Linear warm-up over ``WARMUP`` steps, then cosine to a tenth (a plain function: the
    scheduler's state stays JSON-able for the checkpoints)."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    done = min(1.0, (step - WARMUP) / (STEPS - WARMUP))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * done))


class Schedule:
    """``cosine`` times ``hot`` from step ``hot_from`` on (a learning rate set too hot, as a
    typo or a bad sweep does). An object whose attributes are its whole state: LambdaLR saves
    them with the scheduler, so a checkpoint restores the same schedule."""

    def __init__(self, hot: float = 1.0, hot_from: int = STEPS) -> None:
        self.hot = hot
        self.hot_from = hot_from

    def __call__(self, step: int) -> float:
        return cosine(step) * (self.hot if step >= self.hot_from else 1.0)


def forward_loss(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, logit_scale: float = 1.0
) -> torch.Tensor:
    """``recovery_ranks.forward_loss`` (one input position masked from the global RNG), with
    the logits scaled by ``logit_scale``."""
    x = x.clone()
    x[:, torch.randint(0, x.shape[1], ())] = 0
    logits = model(x) * logit_scale
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@contextlib.contextmanager
def hidden_fault(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """While on: the MLP output of the middle block times 1000, a fault deep in the forward
    (a flipped exponent in one matmul) that the layer norms after it partly hide."""
    if not on:
        yield
        return
    mlp = model.module.blocks[1].mlp  # type: ignore[index,union-attr]
    handle = mlp.register_forward_hook(lambda module, args, out: out * 1e3)
    try:
        yield
    finally:
        handle.remove()


def bad_batches_run(
    rank: int,
    world: int,
    root: str,
    bad: list[int],
    skip_outliers: bool = True,
    fault: str = "shard",
    hot: float = 1.0,
    closure: bool = False,
) -> dict[str, Any]:
    """Train ``STEPS`` steps with a fault at each batch id in ``bad`` (``fault``: "shard", rank
    0's loss x 5; "logits", rank 1's logits x 1000; "hidden", rank 1's ``hidden_fault``;
    "hot_lr": the learning rate times ``hot`` from the first step in ``bad`` on). ``closure``:
    the loop gives ``agent.step`` a closure that computes the step again on the same batch,
    where a bad shard is bad again and a fault in the forward does not come back."""
    torch.manual_seed(0)
    model = wrap("ddp", TinyGPT(**TINY), world)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    schedule = Schedule(hot, bad[0]) if fault == "hot_lr" else Schedule()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    agent = torchvitals.watch(
        model,
        opt,
        sched,
        checkpoint_dir=os.path.join(root, "ckpt"),
        checkpoint_every=10,
        skip_outliers=skip_outliers,
        metrics_port=0,
        log_dir="",
    )
    steps: list[dict[str, Any]] = []
    unchanged: dict[int, bool] = {}
    aborted = None
    try:
        data = dataset("ddp", 2 * STEPS, rank)
        while agent.step_count < STEPS and aborted is None:
            for bid, x, y in agent.batches(data):
                faulty = fault != "hot_lr" and bid in bad and rank == (fault != "shard")
                with hidden_fault(model, faulty and fault == "hidden"):
                    loss = forward_loss(model, x, y, 1e3 if faulty and fault == "logits" else 1.0)
                if faulty and fault == "shard":
                    loss = loss * 5.0
                loss.backward()
                before = [p.detach().clone() for p in model.parameters()] if bid in bad else None

                def again(x=x, y=y, faulty=faulty) -> torch.Tensor:
                    recomputed = forward_loss(model, x, y)
                    if faulty and fault == "shard":
                        recomputed = recomputed * 5.0
                    recomputed.backward()
                    return recomputed

                try:
                    report = agent.step(loss, closure=again if closure else None)
                except TrainingAborted as e:  # the loop guard: the job would exit here
                    aborted = {"step": agent.step_count + 1, "code": e.code}
                    break
                opt.zero_grad(set_to_none=True)
                if before is not None:
                    unchanged[report.step] = all(
                        torch.equal(a, b) for a, b in zip(before, model.parameters())
                    )
                steps.append(
                    {
                        "step": report.step,
                        "batch": bid,
                        "action": str(report.action),
                        "remedy": report.remedy,
                        "rerun": None  # its seconds are this rank's own: left out
                        if report.rerun is None
                        else {k: v for k, v in report.rerun.to_dict().items() if k != "seconds"},
                        "to_step": None if report.rollback is None else report.rollback.to_step,
                        "repeat_of": None if report.rollback is None else report.rollback.repeat_of,
                        "loss": report.loss,
                        "lr": report.lr,
                        "nonfinite": report.nonfinite,
                        "verdicts": sorted({v.pattern for v in report.verdicts}),
                        "ranks": sorted(
                            {r for v in report.verdicts for r in v.evidence.get("ranks", [])}
                        ),
                        "culprit_from": sorted(
                            {str(v.evidence.get("culprit_from")) for v in report.verdicts}
                            - {"None"}
                        ),
                        "activation_ranks": report.activation_ranks,
                    }
                )
                if agent.step_count >= STEPS:
                    break
        final = eval_loss(model, "ddp")
    finally:
        agent.close()
    out: dict[str, Any] = {
        "steps": steps,
        "unchanged": unchanged,
        "final_loss": final,
        "aborted": aborted,
    }
    if rank == 0:
        accounted = account(os.path.join(root, "ckpt"))
        out["goodput"] = accounted.goodput
        out["badput"] = dict(accounted.badput)
        incidents, _ = IncidentLog(os.path.join(root, "ckpt")).read()
        out["incidents"] = [
            (i.kind, i.step, i.culprit.rank, i.remedy, i.repeat_of) for i in incidents
        ]
    return out
