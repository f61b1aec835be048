"""Scenarios on 4 gloo ranks laid out as HSDP or FSDP x tensor parallel (``support.meshes``);
each asserts against an independent single-process reference fed the same global batch and
returns plain data for the parent to compare across ranks (test_mesh_exact.py,
test_mesh_rollback.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from recovery_ranks import BASE_LR, WATCH, compare, describe, lr_lambda, params
from support.llamalike import LlamaLike
from support.meshes import (
    data_ranks,
    data_slice,
    ddp_over_tensor_parallel,
    holds_first_logit,
    logits_loss,
    shard,
    train_context,
)
from support.models import random_batches
from support.reference import (
    OutputRecorder,
    assert_activations,
    assert_close,
    ref_grad_norms,
    ref_update_ratios,
    snapshot,
)
from support.world import restore_state, snapshot_state

import torchvitals

DIMS = dict(vocab=64, dim=32, n_layers=3, heads=4)
SEQ = 16
PER = 4
"""Samples per data-parallel part of the global batch."""
BLOCKS = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "output", "other"]
"""The blocks the agent finds in ``LlamaLike(**DIMS)`` (the norms are "other")."""
MESH_WATCH = dict(WATCH, checkpoint_every=5)
"""The recovery scenarios' watchdog settings, a checkpoint every 5 steps."""
POISON_STEP = 6
"""The sampled step whose head output gets an Inf at sample 0, position 0, logit 0."""


class Poison:
    """A forward hook that writes an Inf into the head's output at sample 0, position 0, logit
    0 while ``on``: the reference's element of the global batch, local ``[0, 0, 0]`` on the
    ranks that hold it (``holds_first_logit``; a DTensor's local piece). Registered on the model
    after the tensor-parallel output hooks and before the agent's."""

    def __init__(self, on: bool = False):
        self.on = on

    def __call__(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if not self.on:
            return
        local = output.to_local() if hasattr(output, "to_local") else output
        with torch.no_grad():
            local[0, 0, 0] = float("inf")


def exact(rank: int, world: int, kind: str) -> list[dict[str, Any]]:
    """Six steps (sampled every other one) against a single-process reference: per-block and
    total grad norms, per-block update ratios, activation statistics; at the last step an Inf
    in the head's output at one element of the global batch, which must count once."""
    torch.manual_seed(0)
    model = LlamaLike(**DIMS)
    reference = copy.deepcopy(model)
    shard(kind, model)
    poison, ref_poison = Poison(), Poison()
    if holds_first_logit(kind):
        model.output.register_forward_hook(poison)
    reference.output.register_forward_hook(ref_poison)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    agent = torchvitals.watch(model, opt, sample_every=2)
    assert agent.block_names == BLOCKS, agent.block_names
    outputs = BLOCKS[:-1]
    reports, expected_update = [], None
    batch = PER * data_ranks(kind)
    for step, (x, y) in enumerate(
        random_batches(POISON_STEP, batch=batch, seq_len=SEQ, vocab=DIMS["vocab"]), start=1
    ):
        sampled = agent.sampled(step)
        poisoned = step == POISON_STEP
        assert not poisoned or sampled
        poison.on = ref_poison.on = poisoned
        recorder = OutputRecorder(reference, outputs) if sampled else None
        ref_loss = reference.loss(x, y)
        ref_loss.backward()
        norms, total = ref_grad_norms(reference, outputs)
        mine = data_slice(kind, PER)
        with train_context(kind):
            loss = logits_loss(model(x[mine]), y[mine])
            loss.backward()
        report = agent.step(loss)
        what = f"{kind} rank {rank} step {step}"
        if sampled:
            stats = recorder.stats()
            recorder.close()
            for block in outputs:
                if not (poisoned and block == "output"):
                    assert_activations(report.activations[block], stats[block], f"{what} {block}")
        if poisoned:
            # The reference's one Inf, counted once however many ranks hold a copy of it.
            assert stats["output"]["nonfinite"] == 1.0, stats["output"]
            assert report.activations["output"]["nonfinite"] == 1.0, report.activations["output"]
            assert report.action == "skip" and report.nonfinite_loss, report.action
            reports.append(_global(report))
            break
        assert_close(report.loss, ref_loss.item(), what=f"{what} loss")
        for block, value in norms.items():
            assert_close(report.grad_norm[block], value, what=f"{what} grad_norm[{block}]")
        assert_close(report.grad_norm_total, total, what=f"{what} total")
        if report.update_ratio:
            assert set(report.update_ratio) == set(expected_update), report.update_ratio
            for block, value in expected_update.items():
                assert_close(report.update_ratio[block], value, what=f"{what} ratio[{block}]")
        before = snapshot(reference)
        ref_opt.step()
        expected_update = ref_update_ratios(before, snapshot(reference), outputs)
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        reports.append(_global(report))
    assert sum(1 for r in reports if r["update_ratio"]) >= 2, reports
    agent.close()
    dist.barrier()
    return reports


def ddp_refused(rank: int, world: int) -> str:
    """watch() on DDP over a tensor-parallel model: the error every rank raises (none hangs)."""
    torch.manual_seed(0)
    model = ddp_over_tensor_parallel(LlamaLike(**DIMS))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        torchvitals.watch(model, opt)
    except torchvitals.TorchvitalsError as exc:
        message = str(exc)
    else:
        raise AssertionError("watch() accepted DDP over a tensor-parallel model")
    dist.barrier()
    return message


def _global(report: Any) -> dict[str, Any]:
    """The fields every rank must agree on."""
    keep = ("step", "loss", "grad_norm", "grad_norm_total", "update_ratio", "activations")
    return {k: v for k, v in report.to_dict().items() if k in keep} | {"action": report.action}


# ---------------------------------------------------------------- a rollback on the mesh

FAULT_STEP = 14
"""Rank 3's loss is NaN here (once): the rollback goes to the checkpoint of step 10."""
BATCHES = 20


def _forward_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The LM loss with one input position masked at random (the global torch RNG, seeded alike
    on the ranks of a tp group), so the run after the rollback also depends on the RNG state
    being restored."""
    x = x.clone()
    x[:, torch.randint(0, x.shape[1], ())] = 0
    return logits_loss(model(x), y)


def _build(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = shard(kind, LlamaLike(**DIMS))
    return model, torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)


def rollback(rank: int, world: int, kind: str, root: str) -> dict[str, Any]:
    """20 batches; rank 3's loss is NaN at step 14. Expected on every rank: a rollback from
    step 14 to the checkpoint of step 10, batches [10, 17) skipped (margin 3) with the LR
    halved, steps 11..13 trained on batches 17..19. The final model is compared here with a
    reference that restores an in-memory copy of step 10's state and trains batches 17..19 at
    half the scheduled LR, without the agent."""
    part = data_slice(kind, 1).start  # which part of the data this rank's tp group trains on
    data = [
        (i, x, y)
        for i, (x, y) in enumerate(
            random_batches(BATCHES, batch=PER, seq_len=SEQ, vocab=DIMS["vocab"], seed=part)
        )
    ]
    model, opt = _build(kind)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    torch.manual_seed(1000 + part)
    agent = torchvitals.watch(model, opt, sched, checkpoint_dir=root, **MESH_WATCH)
    out: dict[str, Any] = {"reports": [], "ids": []}
    snap10 = params10 = None
    injected = False
    for batch_id, x, y in agent.batches(data):
        step = agent.step_count + 1
        out["ids"].append(batch_id)
        with train_context(kind):
            loss = _forward_loss(model, x, y)
            if rank == 3 and step == FAULT_STEP and not injected:
                injected = True
                loss = loss * float("nan")
            loss.backward()
        report = agent.step(loss)
        opt.zero_grad(set_to_none=True)
        out["reports"].append(describe(report))
        if report.step == 10 and report.action == "step" and snap10 is None:
            snap10 = snapshot_state(model, opt)
            params10 = params(model)
    out.update(
        final_step=agent.step_count,
        lr_scale=agent.lr_scale,
        skipped=[[int(a), int(b)] for a, b in agent.skipped_batches],
    )
    final = params(model)
    agent.close()

    # The reference: step 10's state, then batches 17..19 as steps 11..13 at lr x 0.5.
    assert snap10 is not None and params10 is not None
    ref, ref_opt = _build(kind)
    restore_state(ref, ref_opt, snap10)
    for step, (_, x, y) in enumerate(data[FAULT_STEP + WATCH["skip_margin"] :], start=11):
        for group in ref_opt.param_groups:
            group["lr"] = BASE_LR * lr_lambda(step - 1) * 0.5
        with train_context(kind):
            loss = _forward_loss(ref, x, y)
            loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    out["mismatch"] = compare(final, params(ref))
    out["moved_since_10"] = bool(compare(final, params10))
    dist.barrier()
    return out
