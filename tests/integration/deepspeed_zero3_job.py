"""The regression MLP under a raw DeepSpeed ZeRO-3 engine, watched with
``watch(engine, engine.optimizer)``, with a NaN loss on rank 1 at one micro-batch, for
tests/integration/test_deepspeed_zero3.py.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 tests/integration/deepspeed_zero3_job.py OUT --fault-step 5

Each rank writes ``OUT/rank<r>.json``: every report, the engine's own global norm, an fp64
reference of each block's gradient norm computed from every rank's micro-batches, and each
block's update ratio computed from the whole (gathered) parameters around every step.
``--checkpoint-every N`` asks for checkpoints (refused at watch() under ZeRO-3);
``--offload`` offloads the optimizer to the CPU, where its gradient partitions are kept in
buffers torchvitals does not read (reported as missing).
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

ACCUMULATE, CLIP = 2, 0.5


def whole(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each block's parameters, gathered from every rank's partitions (fp64 copies)."""
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {b: [p.detach().double().clone() for p in getattr(model, b).parameters()]
                for b in BLOCKS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--offload", action="store_true")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    model = mlp(named=True)
    ref = copy.deepcopy(model).double()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                                  lr=3e-3)
    config = deepspeed_config(3, ACCUMULATE, CLIP)
    if args.offload:        # with the torch optimizer (DeepSpeed's CPU Adam is a compiled op)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank, world = engine.global_rank, engine.world_size
    watchdog = (dict(checkpoint_dir=os.path.join(args.out, "ckpt"),
                     checkpoint_every=args.checkpoint_every) if args.checkpoint_every else {})
    agent = torchvitals.watch(engine, engine.optimizer, blocks=BLOCKS, log_dir="", metrics_port=0,
                              sample_every=1, **watchdog)
    real: list[float] = []      # this rank's partition norm at each real torch optimizer step
    optimizer.register_step_pre_hook(lambda opt, *_: real.append(math.sqrt(sum(
        float(p.grad.double().pow(2).sum()) for g in opt.param_groups for p in g["params"]
        if p.grad is not None))))
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    out, before_step = [], whole(model)
    for step in range(1, args.steps + 1):
        with torch.no_grad():
            for b in BLOCKS:
                for p, q in zip(getattr(ref, b).parameters(), before_step[b]):
                    p.copy_(q)
        ref.zero_grad(set_to_none=True)
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
        report = agent.last_report
        assert report is not None and report.step == step, f"step {step} went unreported"
        after_step = whole(model)
        ratio = {b: math.sqrt(sum(float((a - w).pow(2).sum())
                                  for a, w in zip(after_step[b], before_step[b])))
                 / math.sqrt(sum(float(w.pow(2).sum()) for w in before_step[b])) for b in BLOCKS}
        before_step = after_step
        norm = engine.get_global_grad_norm()
        ref_norms = {b: math.sqrt(sum(float(p.grad.pow(2).sum())
                                      for p in getattr(ref, b).parameters())) for b in BLOCKS}
        out.append({**describe(report), "grad_norm": report.grad_norm,
                    "missing": report.grad_norm_missing,
                    "update_ratio": report.update_ratio,
                    "update_ratio_step": report.update_ratio_step, "ref_update_ratio": ratio,
                    "engine_norm": None if norm is None else float(norm), "ref": ref_norms,
                    "losses": losses})
    flat = torch.cat([t.flatten() for b in BLOCKS for t in whole(model)[b]])
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"reports": out, "params": flat.tolist(), "step_count": agent.step_count,
                   "real": real, "clip": CLIP}, f)
    agent.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
