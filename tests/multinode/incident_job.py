"""A torchrun worker for the incident tests: DDP over gloo, any number of ranks per node, one
shared folder, and faults injected at a named global rank and step, each once.

    torchrun --nnodes 2 --nproc-per-node 2 ... tests/multinode/incident_job.py \\
        --ckpt CKPT --out OUT --steps 24 --fault spin:2:12 --fault nan:3:16

``--fault KIND:RANK:STEP`` (repeatable) injects KIND on global rank RANK at step STEP; RANK may
also be ``N.L``, local rank L of node N (the supervisor's node: c10d hands out global ranks in
arrival order, so a test that needs a fault on a given node names it so):

- ``stop``: SIGSTOP itself after the step (a hang: the others wait in the next step's collective).
- ``spin``: loop forever in ``spin_forever`` after the step, in user code, outside any collective.
- ``exit13``: ``sys.exit(13)`` after the step (a crash with its own exit status).
- ``kill``: SIGKILL itself after the step.
- ``nan``: its loss of the step is NaN (DDP spreads the gradient to every rank; the agent rolls
  back).
- ``slow``: it sleeps ``--slow-s`` inside its compute (before the forward) every step from STEP
  for ``--slow-steps`` steps (a straggler that recovers).
- ``gated``: after the step, outside any collective, it waits for the file ``gate`` in
  ``--ckpt`` (a test writes it once another death is recorded), then exits with status 7 at once
  (``os._exit``: no teardown that would wait for a dead peer).
- ``hold``: after the step it ignores SIGTERM and waits, outside any collective, until every
  other fault of the run has fired (their markers) and every rank they end has ended, then ends
  by SIGTERM: its node's launcher outlives the faults of both nodes, and no launcher stops a
  faulty rank before it ended by itself.
- ``freeze``: from the step on its heartbeat writes fail (with ENOSPC, as on a full disk) while
  it trains on for ``--freeze-s`` seconds; then it waits in a barrier of a side group every rank
  made at its start, which no other rank enters: every rank waits in a collective, its heartbeat
  the oldest.

Each fault fires once per ``--ckpt``: a marker file there (written before the fault) keeps a
rolled-back or restarted job from repeating it. ``--hang-restarts`` makes every worker torchrun
restarts in the attempt a ``kill`` fired in sleep forever before ``init_process_group`` (torch's
restarted workers stuck in their rendezvous), deterministically on every node: a worker is a
restart when torchrun counts one (``TORCHELASTIC_RESTART_COUNT``) or when it already started once
in this attempt (a membership change torchrun does not count).

Every rank appends JSON lines to ``--out``: ``resumed`` (the step it resumed from), ``fault``
(the fault, with the unix time it was injected), ``step`` (each step's number, its start and end
in unix seconds, the action taken), ``stuck`` and ``finished``; each line carries the rank, its node
(the supervisor's, ``MULTINODE_TEST_NODE``), the supervisor's attempt and torchrun's restart
count.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: the support package

KINDS = ("stop", "spin", "exit13", "kill", "nan", "slow", "gated", "hold", "freeze")
AFTER_STEP = ("stop", "spin", "exit13", "kill", "gated", "hold", "freeze")
"""Faults fired once the step is done."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: str
    """A global rank (``3``), or node N's local rank L (``N.L``)."""
    step: int

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, rank, step = text.split(":")
        if kind not in KINDS:
            raise argparse.ArgumentTypeError(f"fault kind {kind!r} is not one of {KINDS}")
        if not all(part.isdigit() for part in rank.split(".")) or rank.count(".") > 1:
            raise argparse.ArgumentTypeError(f"fault rank {rank!r} is not R nor N.L")
        return cls(kind, rank, int(step))

    def mine(self, rank: int) -> bool:
        """Whether this process (global rank ``rank``) is the fault's."""
        if "." not in self.rank:
            return int(self.rank) == rank
        node, local = self.rank.split(".")
        here = os.environ.get("MULTINODE_TEST_NODE"), os.environ.get("LOCAL_RANK")
        return here == (node, local)

    def marker(self, ckpt: str) -> Path:
        return Path(ckpt) / f"fault-{self.kind}-r{self.rank}-s{self.step}-done"


def record(out: str, **fields) -> None:
    line = {
        "rank": int(os.environ["RANK"]),
        "time": time.time(),
        "attempt": int(os.environ.get("TORCHVITALS_SUPERVISOR_ATTEMPT", 0)),
        "elastic_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "pid": os.getpid(),
        # The supervisor's node this rank runs under (the test's truth), and torchrun's group
        # rank, which c10d assigns in arrival order and may differ from it.
        "node": int(os.environ.get("MULTINODE_TEST_NODE", -1)),
        "group_rank": int(os.environ.get("GROUP_RANK", -1)),
        "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
        "host": socket.gethostname(),
        **fields,
    }
    # One write of one short line in append mode: the ranks' lines never interleave.
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def spin_forever() -> None:
    """Busy in user code, in Python, never returning: what a rank's stack must show."""
    n = 0
    while True:
        n = (n * 31 + 7) % 1_000_003


def inject(fault: Fault, args: argparse.Namespace) -> None:
    """Write the marker, record the time, then fire (the fault's time is before it fires)."""
    if fault.kind == "gated":  # its turn comes when the test says so, outside any collective
        wait_for(lambda: (Path(args.ckpt) / "gate").exists())
    if fault.kind == "hold":  # SIGTERM from torchrun waits until the other faults fired
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fault.marker(args.ckpt).write_text(
        json.dumps(
            {"pid": os.getpid(), "attempt": os.environ.get("TORCHVITALS_SUPERVISOR_ATTEMPT")}
        )
    )
    record(args.out, event="fault", kind=fault.kind, step=fault.step, at=time.time())
    if fault.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "spin":
        spin_forever()
    elif fault.kind == "exit13":
        sys.exit(13)
    elif fault.kind == "gated":
        # At once: a teardown would wait on its peers' collectives, the first one's dead.
        os._exit(7)
    elif fault.kind == "hold":
        others = [f for f in args.fault if f.kind != "hold"]
        wait_for(lambda: all(fired(f, args.ckpt) for f in others))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: False)  # the signal ends it
    elif fault.kind == "freeze":
        break_heartbeat()


def fired(fault: Fault, ckpt: str) -> bool:
    """Whether ``fault`` fired, and the rank it ends (its marker names it) has ended: gone, or a
    zombie its launcher has not reaped yet."""
    marker = fault.marker(ckpt)
    if not marker.exists():
        return False
    if fault.kind not in ("exit13", "gated", "kill"):
        return True
    try:
        pid = json.loads(marker.read_text())["pid"]
    except ValueError:  # the marker is being written
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def wait_for(condition) -> None:
    """Poll ``condition`` until it holds: the event itself, however long it takes."""
    while not condition():
        time.sleep(0.01)


def break_heartbeat() -> None:
    """Make the agent's heartbeat writes fail from now on, as a full disk fails them: each write
    of this rank's heartbeat file raises ENOSPC (a write under way finishes first)."""
    import errno

    from torchvitals import protocol

    path = protocol.heartbeat_path(os.environ[protocol.HEARTBEAT_DIR_ENV], int(os.environ["RANK"]))
    write = protocol.replace_json

    def full_disk(target: Path, value: object, *args: object, **kwargs: object) -> None:
        if Path(target) == path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
        write(target, value, *args, **kwargs)  # type: ignore[arg-type]

    protocol.replace_json = full_disk  # type: ignore[assignment]


def stuck_restart(args: argparse.Namespace) -> bool:
    """Whether this worker is a restart, within the attempt a ``kill`` fired in, that must hang
    before its rendezvous (``--hang-restarts``)."""
    if not args.hang_restarts:
        return False
    rank, attempt = os.environ["RANK"], os.environ.get("TORCHVITALS_SUPERVISOR_ATTEMPT", "0")
    started = Path(args.ckpt) / f"started-a{attempt}-r{rank}"
    started.parent.mkdir(parents=True, exist_ok=True)
    restarted = started.exists() or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    started.touch()
    if not restarted:
        return False
    for fault in args.fault:
        if fault.kind == "kill" and fault.marker(args.ckpt).exists():
            fired = json.loads(fault.marker(args.ckpt).read_text())
            if fired.get("attempt") == attempt:
                return True
    return False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--fault", type=Fault.parse, action="append", default=[])
    parser.add_argument(
        "--sleep", type=float, default=0.05, help="seconds of work per step, inside compute"
    )
    parser.add_argument("--slow-s", type=float, default=0.3)
    parser.add_argument("--slow-steps", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--freeze-s", type=float, default=6.0)
    parser.add_argument("--hang-restarts", action="store_true")
    args = parser.parse_args()

    if stuck_restart(args):
        record(args.out, event="stuck")
        while True:  # stuck before the rendezvous: only the supervisor can end this
            time.sleep(3600)

    import torch
    import torch.distributed as dist
    from support.models import TINY, TinyGPT, random_batches

    import torchvitals

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    # Every rank makes the side group a ``freeze`` waits in (new_group is collective).
    side = dist.new_group() if any(f.kind == "freeze" for f in args.fault) else None
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # heartbeat_dir and the job id come from the supervisor; synchronous saves, so a fault after
    # step 12 finds step 10 committed.
    agent = torchvitals.watch(
        model,
        opt,
        checkpoint_dir=args.ckpt,
        checkpoint_every=args.checkpoint_every,
        healthy_window=2,
        snapshot_max_bytes=0,
    )
    record(args.out, event="resumed", step=agent.resumed_from)
    data = list(
        random_batches(400, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=rank)
    )
    mine = [f for f in args.fault if f.mine(rank)]
    frozen_at: float | None = None
    slow = next((f for f in mine if f.kind == "slow"), None)
    slow_first = slow is not None and not slow.marker(args.ckpt).exists()
    for x, y in agent.batches(data):
        t0 = time.time()
        step = agent.step_count + 1
        if slow_first and slow is not None and slow.step <= step < slow.step + args.slow_steps:
            if step == slow.step:
                inject(slow, args)
            time.sleep(args.slow_s)
        time.sleep(args.sleep)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )
        for fault in mine:
            if fault.kind == "nan" and step == fault.step and not fault.marker(args.ckpt).exists():
                inject(fault, args)
                loss = loss * float("nan")
        loss.backward()
        report = agent.step(loss)
        opt.zero_grad(set_to_none=True)
        record(
            args.out,
            event="step",
            step=report.step,
            t0=t0,
            t1=time.time(),
            action=str(getattr(report.action, "value", report.action)),
        )
        for fault in mine:
            if (
                fault.kind in AFTER_STEP
                and report.step == fault.step
                and not fault.marker(args.ckpt).exists()
            ):
                inject(fault, args)
                if fault.kind == "freeze":
                    frozen_at = time.monotonic()
        if frozen_at is not None and time.monotonic() - frozen_at >= args.freeze_s:
            dist.barrier(group=side)  # no other rank comes: the job hangs here
        if agent.step_count >= args.steps:
            break
    agent.close()
    record(args.out, event="finished", step=agent.step_count)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
