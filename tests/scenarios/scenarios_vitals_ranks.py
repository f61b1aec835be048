"""Rank functions for tests/scenarios/test_scenarios_vitals.py (spawned by support.world.run_world).

Each trains the tiny GPT under DDP (gloo, world size 2) and returns plain data: per step the
verdicts, the action and a checksum of the rank's parameters, so the parent can compare ranks.
"""

from __future__ import annotations

import time

import torch
from support.models import TINY, TinyGPT, random_batches
from torch.nn.parallel import DistributedDataParallel as DDP

import torchvitals


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _verdicts(report) -> list[tuple]:
    return [
        (v.pattern, v.severity, v.block, v.step, v.evidence.get("blocks"), v.evidence.get("ranks"))
        for v in report.verdicts
    ]


def _checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def corrupted_replica(
    rank: int,
    world: int,
    iterations: int,
    bad_rank: int,
    bad_step: int,
    param: str,
    checkpoint_dir: str | None,
    sample_every: int,
) -> dict:
    """``bad_rank`` alone changes one element of ``param`` in place at ``bad_step``, after the
    backward's all-reduce (a bit flipped in its memory): the gradients stay identical, only the
    replicas' weights differ from then on. ``bad_step`` < 0 injects nothing (the control)."""
    torch.manual_seed(0)
    model = DDP(TinyGPT(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = dict(model.module.named_parameters())[param]
    data = list(
        random_batches(iterations, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank)
    )
    out, injected = [], False
    watch = dict(sample_every=sample_every, metrics_port=0, log_dir="")
    if checkpoint_dir:
        watch.update(
            checkpoint_dir=checkpoint_dir, checkpoint_every=2 * sample_every, healthy_window=2
        )
    with torchvitals.watch(model, opt, **watch) as agent:
        for x, y in agent.batches(data):
            loss = _loss(model, x, y)
            loss.backward()
            step = agent.step_count + 1
            if rank == bad_rank and step == bad_step and not injected:
                with torch.no_grad():
                    target.view(-1)[0] += 1e-3  # in place, on this replica alone
                injected = True
            report = agent.step(loss)
            opt.zero_grad(set_to_none=True)
            out.append(
                {
                    "step": report.step,
                    "verdicts": _verdicts(report),
                    "action": report.action,
                    "checked": report.replicas.checked,
                    "to_step": report.rollback.to_step if report.rollback else None,
                    "checksum": _checksum(model),
                }
            )
        history = [(v.pattern, v.step) for v in agent.detector.history]
    return {"steps": out, "history": history, "checksum": _checksum(model)}


def loader_stall_on_one_rank(
    rank: int, world: int, steps: int, slow: int, from_step: int, delay_s: float, by: str
) -> dict:
    """Rank ``slow`` is slow from ``from_step`` on: its loader sleeps (``by="data"``, drawn
    through ``agent.batches``) or its forward does extra work (``by="compute"``)."""
    torch.manual_seed(0)
    model = DDP(TinyGPT(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = list(
        random_batches(steps, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank)
    )

    def loader():
        for i, batch in enumerate(data, start=1):
            if by == "data" and rank == slow and i >= from_step:
                time.sleep(delay_s)
            yield batch

    out = []
    with torchvitals.watch(model, opt, metrics_port=0, log_dir="") as agent:
        for i, (x, y) in enumerate(agent.batches(loader()), start=1):
            if by == "compute" and rank == slow and i >= from_step:
                end = time.perf_counter() + delay_s
                while time.perf_counter() < end:  # busy: compute, not waiting
                    pass
            loss = _loss(model, x, y)
            loss.backward()
            report = agent.step(loss)
            opt.zero_grad(set_to_none=True)
            out.append(
                {
                    "step": report.step,
                    "wait": report.timing.data_wait_seconds,
                    "ratio": report.timing.data_wait_ratio,
                }
            )
        stragglers = [
            (v.step, v.evidence["rank"], v.evidence.get("cause"))
            for v in agent.detector.history
            if v.pattern == "straggler"
        ]
        others = [(v.pattern, v.step) for v in agent.detector.history if v.pattern != "straggler"]
    return {"steps": out, "stragglers": stragglers, "others": others}
