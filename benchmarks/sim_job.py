"""A torch-free stand-in for torchrun and its ranks, the job ``cluster_sim.py`` has every node's
supervisor start.

    torchvitals supervise ... -- python benchmarks/sim_job.py --nnodes 8 --nproc 1 \\
        --ckpt CKPT --sync SYNC --control CONTROL

Started without ``--local-rank`` it is the launcher: it starts ``--nproc`` ranks (itself again,
with ``--local-rank``), says on stderr what torchrun says when a worker fails, stops the others
and exits 1; on SIGTERM (the supervisor's stop, or its death) it stops its ranks and exits.

A rank trains in lockstep with every other rank of the job: a step of ``--step-s`` seconds, then
a wait at a barrier in the shared ``--sync`` folder (a function named ``all_reduce``, so the
supervisor reads a rank waiting there as waiting in a collective, as it reads a real one). What
the supervisor sees of it is written by the agent's own writers, so it cannot drift from what a
real rank writes: the heartbeat (``agent.recover.heartbeat.Heartbeat``), the stacks on the stack
signal (``agent.recover.stacks.StackDumps``), the ledger's checkpoints (``records.ledger.Ledger``,
global rank 0, every ``--checkpoint-every`` steps) and the goodput step lines
(``records.timeline.StepTimeline``, global rank 0). It resumes from the ledger's last checkpoint.

The simulator steers it through files in ``--control``: ``fault.json`` (``{"case", "rank",
"step"}``: that rank crashes, hangs or stops itself at that step, once per job: ``fault-done.json``
records when) and ``finish.json`` (``{"step"}``: every rank ends cleanly after that step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from torchvitals.agent.recover.heartbeat import Heartbeat
from torchvitals.agent.recover.stacks import StackDumps
from torchvitals.protocol import (
    ATTEMPT_ENV,
    CHECKPOINT,
    HEARTBEAT_DIR_ENV,
    LEDGER_FILE,
    NODE_ENV,
    TRAIN,
)
from torchvitals.records.jobid import job_identity
from torchvitals.records.ledger import Ledger
from torchvitals.records.timeline import StepTimeline

CRASH_EXIT_CODE = 13
"""A crashing rank's exit status (the one torch's own elastic tests use)."""

FAULT_FILE, DONE_FILE, FINISH_FILE = "fault.json", "fault-done.json", "finish.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--nproc", type=int, default=1, help="ranks per node")
    p.add_argument("--ckpt", type=Path, required=True, help="the job's shared checkpoint folder")
    p.add_argument("--sync", type=Path, required=True, help="the shared folder of the barriers")
    p.add_argument("--control", type=Path, required=True, help="the simulator's orders")
    p.add_argument("--step-s", type=float, default=0.5, help="seconds a step takes")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--local-rank", type=int, default=None, help="(set by the launcher)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the launcher


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start the node's ranks and wait for them as torchrun does; returns the exit status."""
    node = int(os.environ[NODE_ENV])
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    ranks = {}
    for local in range(args.nproc):
        env = {
            **os.environ,
            "RANK": str(node * args.nproc + local),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(args.nnodes * args.nproc),
            "GROUP_RANK": str(node),
        }
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--local-rank", str(local)]
        ranks[local] = subprocess.Popen(cmd, env=env)
    while True:
        if stopping:
            _stop(ranks.values())
            return 128 + stopping[0]
        codes = {local: p.poll() for local, p in ranks.items()}
        failed = [(local, code) for local, code in codes.items() if code not in (None, 0)]
        if failed:
            local, code = failed[0]
            # torchrun's own words (torch.distributed.elastic.multiprocessing.api), which the
            # supervisor reads for a status the kernel no longer had.
            print(
                f"[sim_job] failed (exitcode: {code}) local_rank: {local} "
                f"(pid: {ranks[local].pid}) of binary: {sys.executable}",
                file=sys.stderr,
                flush=True,
            )
            _stop(ranks.values())
            return 1
        if all(code == 0 for code in codes.values()):
            return 0
        time.sleep(0.1)  # torchrun's --monitor-interval, as the multi-node tests set it


def _stop(ranks: Any) -> None:
    for p in ranks:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
    for p in ranks:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---------------------------------------------------------------- a rank


def all_reduce(folder: Path, step: int, rank: int, world: int, poll_s: float = 0.05) -> None:
    """Wait until every rank reached ``step`` (named after the collective it stands in for:
    the supervisor's stack reader counts a rank waiting here as waiting on the others)."""
    here = folder / f"s{step:08d}"
    here.mkdir(parents=True, exist_ok=True)
    (here / f"r{rank}").touch()
    while len(os.listdir(here)) < world:
        time.sleep(poll_s)


def stuck_in_user_code() -> None:
    """A rank that stopped stepping but lives: it spins here, outside any collective."""
    while True:
        time.sleep(0.05)


def _order(control: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((control / name).read_text())
    except (OSError, ValueError):
        return None


def _inject(control: Path, case: str, rank: int, step: int) -> None:
    """Fail as ``case`` says, once per job (the marker keeps a restarted job from repeating it)."""
    (control / DONE_FILE).write_text(
        json.dumps(
            {"case": case, "rank": rank, "step": step, "pid": os.getpid(), "time": time.time()}
        )
    )
    if case == "crash":
        os._exit(CRASH_EXIT_CODE)
    if case == "hang":
        stuck_in_user_code()
    if case == "stopped":
        os.kill(os.getpid(), signal.SIGSTOP)


def train(args: argparse.Namespace) -> int:
    """One rank: resume from the ledger, step in lockstep, beat, checkpoint, fail when told."""
    folder = os.environ[HEARTBEAT_DIR_ENV]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get(ATTEMPT_ENV, "0"))
    sync = args.sync / f"a{attempt:04d}"
    # torchrun's rendezvous and init_process_group: every rank of the attempt is up before the
    # agent's first heartbeat (watch() runs after them), so a slow start of many processes is
    # the supervisor's startup phase, never a hang in training.
    all_reduce(sync, 0, rank, world)
    heartbeat = Heartbeat(folder, rank, flush=True)
    stacks = StackDumps.open(folder, rank)
    if stacks is not None:
        heartbeat.stack_signal = stacks.signum
    heartbeat.beat(0, CHECKPOINT)
    ledger = Ledger(args.ckpt / LEDGER_FILE, writer=rank == 0).load()
    if rank == 0 and ledger.job_id is None:
        ledger.job_id = job_identity()
    last = ledger.last_checkpoint
    step = 0 if last is None else int(last["step"])
    heartbeat.beat(0, TRAIN)
    timeline = StepTimeline(args.ckpt, attempt=attempt) if rank == 0 else None
    began = previous = time.time()
    if timeline is not None:
        timeline.start(at=began, resumed=step)
    ticks, fault, finish = 0, None, None
    while finish is None or step < finish:
        time.sleep(max(0.0, began + (ticks + 1) * args.step_s - time.time()))
        step, ticks = step + 1, ticks + 1
        fault = fault or _order(args.control, FAULT_FILE)
        if (
            fault is not None
            and fault["rank"] == rank
            and fault["step"] == step
            and not (args.control / DONE_FILE).exists()
        ):
            _inject(args.control, fault["case"], rank, step)
        all_reduce(sync, step, rank, world)
        heartbeat.beat(ticks)
        now = time.time()
        if timeline is not None:
            timeline.step(step, end=now, seconds=now - previous)
        previous = now
        if rank == 0 and step % args.checkpoint_every == 0:
            ledger.record_checkpoint(step, args.ckpt / f"step-{step:08d}")
        if finish is None and (order := _order(args.control, FINISH_FILE)) is not None:
            finish = int(order["step"])
    heartbeat.forget_stacks()
    if stacks is not None:
        stacks.close()
    heartbeat.close()
    if timeline is not None:
        timeline.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return launch(args, argv) if args.local_rank is None else train(args)


if __name__ == "__main__":
    sys.exit(main())
