"""examples/deepspeed_train.py's model under a raw DeepSpeed engine (ZeRO stage from the
command line), watched with ``watch(engine, engine.optimizer)``, with a NaN loss on rank 1 at one
micro-batch, for tests/integration/test_deepspeed.py.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 tests/integration/deepspeed_job.py OUT --stage 2

Each rank writes ``OUT/rank<r>.json``: every report, the engine's own global norm, and an fp64
reference of each block's gradient norm computed from every rank's micro-batches.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys

import deepspeed
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]          # real_steps
import torchvitals  # noqa: E402
from real_steps import describe  # noqa: E402
from torchvitals.agent.tools.demo.regression import BLOCKS, deepspeed_config, micro_batch, mlp  # noqa: E402


def build() -> torch.nn.Module:
    return mlp(named=True)


def config(stage: int, accumulate: int, clip: float) -> dict:
    return deepspeed_config(stage, accumulate, clip)


def partition_digest(engine) -> list[list[float]]:
    """This rank's optimizer state, summed per param group: the ZeRO-1/2 fp32 master partition
    and Adam's moments and step over it (stage 0: the torch optimizer's, over the parameters)."""
    zero = engine.optimizer
    if hasattr(zero, "single_partition_of_fp32_groups"):
        pairs = zip(zero.single_partition_of_fp32_groups, [zero.optimizer.state] * 9)
    else:
        pairs = ((p, zero.state) for g in zero.param_groups for p in g["params"])
    out = []
    for master, state in pairs:
        st = state.get(master, {})
        out.append([float(master.double().sum())] + [
            float(st[k].double().sum()) for k in ("exp_avg", "exp_avg_sq", "step") if k in st])
    return out


ACCUMULATE, CLIP = 2, 0.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    model = build()
    ref = copy.deepcopy(model).double()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                                  lr=3e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=config(args.stage, ACCUMULATE, CLIP))
    rank, world = engine.global_rank, engine.world_size
    watchdog = (dict(checkpoint_dir=os.path.join(args.out, "ckpt"),
                     checkpoint_every=args.checkpoint_every) if args.checkpoint_every else {})
    agent = torchvitals.watch(engine, engine.optimizer, blocks=BLOCKS, log_dir="", metrics_port=0,
                              **watchdog)
    resumed = {"step": agent.resumed_from, "digest": partition_digest(engine),
               "lr": [g["lr"] for g in engine.optimizer.param_groups]}
    digests = {}
    real: list[float] = []      # the gradient norm each real step of the torch optimizer saw
    optimizer.register_step_pre_hook(lambda opt, *_: real.append(math.sqrt(sum(
        float(p.grad.double().pow(2).sum()) for g in opt.param_groups for p in g["params"]
        if p.grad is not None))))
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    out = []
    for step in range(1, args.steps + 1):
        with torch.no_grad():
            for p, q in zip(ref.parameters(), model.parameters()):
                p.copy_(q.double())
        ref.zero_grad(set_to_none=True)
        before = agent.last_report
        losses = []
        for micro in range(ACCUMULATE):
            batches = [micro_batch(g) for g in gens]
            for x, y in batches:        # the reference: every rank's micro-batches, in fp64
                (torch.nn.functional.mse_loss(ref(x.double()), y.double())
                 / (world * ACCUMULATE)).backward()
            x, y = batches[rank]
            loss = torch.nn.functional.mse_loss(engine(x), y)
            losses.append(loss.item())
            if rank == 1 and step == args.fault_step and micro == 0:
                loss = loss * float("nan")
            agent.record_loss(loss.detach())
            engine.backward(loss)
            engine.step()
        assert agent.last_report is not before, f"step {step} went unreported"
        if agent.last_report.checkpointed:
            digests[agent.last_report.step] = partition_digest(engine)
        if agent.last_report.action == "rollback":
            digests["rolled back"] = partition_digest(engine)
        norm = engine.get_global_grad_norm()
        ref_norms = {b: math.sqrt(sum(float(p.grad.pow(2).sum())
                                      for p in getattr(ref, b).parameters())) for b in BLOCKS}
        out.append({**describe(agent.last_report), "grad_norm": agent.last_report.grad_norm,
                    "engine_norm": None if norm is None else float(norm), "ref": ref_norms,
                    "losses": losses})
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"reports": out, "params": flat.tolist(), "step_count": agent.step_count,
                   "real": real, "resumed": resumed, "digests": digests,
                   "clip": CLIP}, f)
    agent.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
