"""A torchrun worker for the multi-node tests: one rank per node, gloo, one shared folder.

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P \\
        tests/multinode/node_job.py --ckpt CKPT --out OUT --steps 20 --fault kill --fault-rank 1

Global rank ``--fault-rank`` injects ``--fault`` (SIGKILL or SIGSTOP of itself) at
``--fault-step``, once per ``--ckpt`` (a marker file there keeps a restarted job from repeating
it); ``--others-pause`` keeps the other ranks out of any collective meanwhile. Every rank
appends one JSON line to ``--out`` when it has resumed (its step, the time, the restart counters
it was started with) and one when it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: the support package

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def record(out: str, **fields) -> None:
    with open(out, "a", encoding="utf-8") as f:
        f.write(
            json.dumps(
                {
                    "rank": int(os.environ["RANK"]),
                    "time": time.time(),
                    "attempt": int(os.environ.get("TORCHVITALS_SUPERVISOR_ATTEMPT", 0)),
                    "elastic_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                    **fields,
                }
            )
            + "\n"
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fault", choices=["none", *FAULTS], default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=12)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument(
        "--hold-at",
        type=int,
        default=0,
        help="every rank waits after this step (outside any collective) until --hold-file "
        "exists: a test that must act while the job is mid-run creates the file once it did, "
        "instead of racing the job to its last step; once the file exists nobody waits",
    )
    parser.add_argument("--hold-file", default="")
    parser.add_argument(
        "--others-pause",
        type=float,
        default=0.0,
        help="seconds the other ranks pause at the fault step (outside any "
        "collective), the first time",
    )
    args = parser.parse_args()

    from support.models import TINY, TinyGPT, random_batches

    import torchvitals

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # heartbeat_dir and the job id come from the supervisor; synchronous saves, so the fault at
    # step 12 finds step 10 committed.
    agent = torchvitals.watch(
        model,
        opt,
        checkpoint_dir=args.ckpt,
        checkpoint_every=5,
        healthy_window=2,
        snapshot_max_bytes=0,
    )
    record(args.out, event="resumed", step=agent.resumed_from)
    data = list(
        random_batches(200, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank)
    )
    marker = Path(args.ckpt) / f"fault-{args.fault}-done"
    first = not marker.exists()
    losses = []
    for x, y in agent.batches(data):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )
        loss.backward()
        report = agent.step(loss)
        losses.append(float(loss))
        opt.zero_grad(set_to_none=True)
        if (
            rank == args.fault_rank
            and args.fault in FAULTS
            and report.step == args.fault_step
            and not marker.exists()
        ):
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), FAULTS[args.fault])
        if rank != args.fault_rank and first and report.step == args.fault_step:
            time.sleep(args.others_pause)
        if args.hold_at and report.step == args.hold_at:
            deadline = time.monotonic() + 120
            while not Path(args.hold_file).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(args.sleep)
        if agent.step_count >= args.steps:
            break
    agent.close()
    record(args.out, event="finished", step=agent.step_count, losses=losses)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
