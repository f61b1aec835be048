"""A 2-rank gloo training job for the supervisor tests, with a fault injected once.

    python tests/integration/supervised_job.py --ckpt CKPT --out OUT --steps 20 --fault kill

The parent forks two ranks and, like torchrun, exits 1 (killing the other rank) as soon as one
rank dies, 0 when both finish. Rank 1 injects ``--fault`` (SIGKILL or SIGSTOP of itself) at
``--fault-step`` once per ``--ckpt``: a marker file there keeps a restarted job from repeating it;
``--fault nan`` makes its loss NaN at every step from ``--fault-step`` on, so the watchdog's
rollbacks cannot cure it and its loop guard aborts the job.
Rank 0 appends one JSON line per attempt to ``--out``: the step it resumed from and its last step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
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


def rank_main(rank: int, port: int, args: argparse.Namespace) -> None:
    from support.models import TINY, TinyGPT, random_batches

    import torchvitals

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # heartbeat_dir comes from TORCHVITALS_HEARTBEAT_DIR, set by the supervisor.
    # Synchronous saves: the kill at step 12 must find step 10 committed. A background save
    # commits a step or more after it was staged, which tests/distributed/test_async_checkpoint.py
    # covers; here the subject is the supervisor.
    agent = torchvitals.watch(
        model,
        opt,
        checkpoint_dir=args.ckpt,
        checkpoint_every=5,
        healthy_window=2,
        snapshot_max_bytes=0,
    )
    resumed = agent.resumed_from
    data = list(
        random_batches(200, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank)
    )
    marker = Path(args.ckpt) / f"fault-{args.fault}-done"
    for x, y in agent.batches(data):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )
        if rank == 1 and args.fault == "nan" and agent.step_count + 1 >= args.fault_step:
            loss = loss * float("nan")  # every time: rollbacks cannot cure it
        loss.backward()
        report = agent.step(loss)
        opt.zero_grad(set_to_none=True)
        if (
            rank == 1
            and args.fault in FAULTS
            and report.step == args.fault_step
            and not marker.exists()
        ):
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), FAULTS[args.fault])
        time.sleep(args.sleep)
        if agent.step_count >= args.steps:
            break
    agent.close()
    if rank == 0:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"resumed_from": resumed, "last_step": agent.step_count}) + "\n")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fault", choices=["none", "nan", *FAULTS], default="none")
    parser.add_argument("--fault-step", type=int, default=12)
    parser.add_argument("--sleep", type=float, default=0.02)
    args = parser.parse_args()
    from support.ports import free_port

    port = free_port()  # below the ephemeral range: no outgoing connection takes it first
    # fork: the ranks share the parent's imported torch instead of importing it again.
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r, port, args)) for r in range(2)]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
            return 1
        time.sleep(0.05)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
