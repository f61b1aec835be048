"""examples/deepspeed_train.py's model under a raw DeepSpeed engine (ZeRO stage 0-3 from the
command line), watched with ``watch(engine, engine.optimizer)``, with a NaN loss on rank 1 at one
micro-batch, for tests/integration/test_deepspeed.py and test_deepspeed_zero3.py.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 \\
        tests/integration/deepspeed_job.py OUT --stage 2

Each rank writes ``OUT/rank<r>.json``: every report, the engine's own global norm, an fp64
reference of each block's gradient norm computed from every rank's micro-batches, each block's
update ratio computed from the whole parameters around every step, and digests of this rank's
partition state at each checkpoint, after a rollback and right after ``watch()``. After a
rollback to step ``s`` the micro-batches of step ``s + 1`` are drawn again (as a resumable data
loader would), so the step after the rollback sees the weights and the batches step ``s + 1``
saw. ``--checkpoint-every N`` asks for checkpoints; ``--persistence-threshold 0`` (stage 3)
keeps no parameter gathered between steps (DeepSpeed keeps small ones whole by default);
``--offload`` (stage 3) offloads the optimizer to the CPU, where its gradient partitions are
kept in buffers torchvitals does not read (reported as missing).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]  # real_steps
from real_steps import describe, exit_after, finish  # noqa: E402

import torchvitals  # noqa: E402
from torchvitals.agent.tools.demo.regression import BLOCKS, deepspeed_config, micro_batch, mlp  # noqa: E402

ACCUMULATE, CLIP = 2, 0.5


def _digest(tensors: list) -> str:
    """The exact bytes of ``tensors`` (and any plain values), hashed."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(
            t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            if isinstance(t, torch.Tensor)
            else repr(t).encode()
        )
    return h.hexdigest()


def _state(state: dict) -> list:
    return [state[k] for k in ("exp_avg", "exp_avg_sq", "step") if k in state]


def partition_digest(engine) -> list[str]:
    """This rank's optimizer state (and under ZeRO-3 its parameter partitions), one digest
    each: ZeRO-3's ``ds_tensor`` partitions, then per sub-group its fp32 partition and Adam's
    state over it; ZeRO-1/2 per param group its fp32 master partition and Adam's state; stage
    0 per parameter the parameter and Adam's state."""
    zero = engine.optimizer
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        inner = zero.optimizer
        masters = zero.fp32_partitioned_groups_flat
        return [_digest([p.ds_tensor for p in engine.module.parameters()])] + [
            _digest([m, *_state(inner.state.get(m, {}))]) for m in masters
        ]
    if hasattr(zero, "single_partition_of_fp32_groups"):
        inner = zero.optimizer
        return [
            _digest([m, *_state(inner.state.get(m, {}))])
            for m in zero.single_partition_of_fp32_groups
        ]
    return [
        _digest([p, *_state(zero.state.get(p, {}))]) for g in zero.param_groups for p in g["params"]
    ]


def whole(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each block's parameters as fp64 copies, under ZeRO-3 put together from every rank's
    partition (``ds_tensor``) with a plain all-gather: DeepSpeed's own gathering is left
    alone, so whatever whole copy it keeps (or drops) is what the next forward sees."""
    out = {}
    for b in BLOCKS:
        out[b] = []
        for p in getattr(model, b).parameters():
            part = getattr(p, "ds_tensor", None)
            if part is None:
                out[b].append(p.detach().double().clone())
                continue
            pieces = [torch.empty_like(part) for _ in range(dist.get_world_size())]
            dist.all_gather(pieces, part.detach().contiguous())
            out[b].append(torch.cat(pieces)[: p.ds_numel].view(p.ds_shape).double())
    return out


def gathered(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, flat, as DeepSpeed gathers them (``GatheredParameters``)."""
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return torch.cat(
            [p.detach().flatten().clone() for b in BLOCKS for p in getattr(model, b).parameters()]
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--persistence-threshold", type=int, default=None)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    model = mlp(named=True)
    ref = copy.deepcopy(model).double()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=3e-3
    )
    config = deepspeed_config(args.stage, ACCUMULATE, CLIP)
    if args.offload:  # with the torch optimizer (DeepSpeed's CPU Adam is a compiled op)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    if args.persistence_threshold is not None:  # 0: no parameter stays gathered (ZeRO-3)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = (
            args.persistence_threshold
        )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank, world = engine.global_rank, engine.world_size
    watchdog = (
        dict(
            checkpoint_dir=os.path.join(args.out, "ckpt"),
            checkpoint_every=args.checkpoint_every,
            trust_steps=1,  # the scenarios' faults come two steps after the checkpoint they restore
        )
        if args.checkpoint_every
        else {}
    )
    # ZeRO-3's update ratio is asserted at every step (read from the parameter partitions).
    sampling = {"sample_every": 1} if args.stage == 3 else {}
    agent = torchvitals.watch(
        engine, engine.optimizer, blocks=BLOCKS, log_dir="", metrics_port=0, **sampling, **watchdog
    )
    resumed = {
        "step": agent.resumed_from,
        "digest": partition_digest(engine),
        "lr": [g["lr"] for g in engine.optimizer.param_groups],
    }
    digests = {}
    real: list[float] = []  # the gradient norm each real step of the torch optimizer saw
    optimizer.register_step_pre_hook(
        lambda opt, *_: real.append(
            math.sqrt(
                sum(
                    float(p.grad.double().pow(2).sum())
                    for g in opt.param_groups
                    for p in g["params"]
                    if p.grad is not None
                )
            )
        )
    )
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    out, before_step, drawn = [], whole(model), {}
    for step in range(1, args.steps + 1):
        with torch.no_grad():
            for b in BLOCKS:
                for p, q in zip(getattr(ref, b).parameters(), before_step[b]):
                    p.copy_(q)
        ref.zero_grad(set_to_none=True)
        drawn[step] = [g.get_state() for g in gens]
        before = agent.last_report
        losses = []
        for micro in range(ACCUMULATE):
            batches = [micro_batch(g) for g in gens]
            for x, y in batches:  # the reference: every rank's micro-batches, in fp64
                (
                    torch.nn.functional.mse_loss(ref(x.double()), y.double()) / (world * ACCUMULATE)
                ).backward()
            x, y = batches[rank]
            loss = torch.nn.functional.mse_loss(engine(x), y)
            losses.append(loss.item())
            if rank == 1 and step == args.fault_step and micro == 0:
                loss = loss * float("nan")
            agent.record_loss(loss.detach())
            engine.backward(loss)
            engine.step()
        report = agent.last_report
        assert report is not before, f"step {step} went unreported"
        if report.checkpoint.saved:
            digests[report.step] = partition_digest(engine)
        after_step = whole(model)
        if report.action == "rollback":
            digests["rolled back"] = partition_digest(engine)
            # Go on from the data of the step after the one restored, as a resumable loader does.
            for g, state in zip(gens, drawn[report.rollback.to_step + 1]):
                g.set_state(state)
        ratio = {
            b: math.sqrt(
                sum(float((a - w).pow(2).sum()) for a, w in zip(after_step[b], before_step[b]))
            )
            / math.sqrt(sum(float(w.pow(2).sum()) for w in before_step[b]))
            for b in BLOCKS
        }
        before_step = after_step
        norm = engine.get_global_grad_norm()
        ref_norms = {
            b: math.sqrt(sum(float(p.grad.pow(2).sum()) for p in getattr(ref, b).parameters()))
            for b in BLOCKS
        }
        out.append(
            {
                **describe(report),
                "grad_norm": report.grad_norm,
                "missing": report.grad_norm_missing,
                "update_ratio": report.update_ratio,
                "update_ratio_step": report.update_ratio_step,
                "ref_update_ratio": ratio,
                "engine_norm": None if norm is None else float(norm),
                "ref": ref_norms,
                "losses": losses,
            }
        )
    flat = gathered(model)
    finish(
        agent,
        os.path.join(args.out, f"rank{rank}.json"),
        {
            "reports": out,
            "params": flat.tolist(),
            "step_count": agent.step_count,
            "real": real,
            "resumed": resumed,
            "digests": digests,
            "clip": CLIP,
        },
    )


if __name__ == "__main__":
    exit_after(main)
