"""A torchrun worker for the supervisor's incident tests: gloo ranks that all-reduce every step,
with one fault injected once at a named rank and step.

    torchrun --standalone --nproc-per-node 2 tests/integration/incident_ranks.py \\
        --marks DIR --steps 40 --fault spin --fault-rank 0 --fault-step 5

Each rank does what the agent does for the supervisor, and no more, so the test holds whatever
the agent's state: it registers ``faulthandler`` on ``protocol.STACK_SIGNAL`` (every thread's
stack appended to ``protocol.stack_path``) and writes its heartbeat, naming that signal, after
each step. Faults, once per ``--marks`` folder (a marker file keeps a restarted job from
repeating it): ``stop`` (SIGSTOP itself), ``spin`` (spin in ``spin_forever``, outside any
collective, while the others wait in the next all_reduce), ``exit13`` (exit with status 13 at once).
``--stuck-restart`` makes the workers torchrun restarts after the fault hang before their first
heartbeat, the way a restarted rendezvous can. Rank 0 appends ``{"attempt", "restart",
"last_step", "time"}`` to ``--out`` when it finishes.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchvitals.protocol import (
    HEARTBEAT_DIR_ENV,
    STACK_SIGNAL,
    TRAIN,
    heartbeat_path,
    stack_path,
    write_heartbeat,
)


def spin_forever() -> None:
    """A rank stuck in user code: pure Python, holding the GIL, in no collective."""
    x = 0
    while True:
        x += 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--marks", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault", choices=["none", "stop", "spin", "exit13"], default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--stuck-restart", action="store_true")
    args = parser.parse_args()

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    marker = Path(args.marks) / f"fault-{args.fault}"
    if args.stuck_restart and restart > 0 and marker.exists():
        time.sleep(3600)  # a restarted worker that never finishes its start
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = Path(os.environ[HEARTBEAT_DIR_ENV])
    stacks = open(stack_path(folder, rank), "a")  # noqa: SIM115 (the handler's, for life)
    # chain=False: chaining to the default action of a real-time signal would end the process.
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True, chain=False)

    def beat(step: int) -> None:
        write_heartbeat(
            heartbeat_path(folder, rank),
            step=step,
            time=time.time(),
            phase=TRAIN,
            pid=os.getpid(),
            rank=rank,
            stack_signal=int(STACK_SIGNAL),
        )

    beat(0)
    value = torch.ones(1)
    for step in range(1, args.steps + 1):
        if rank == args.fault_rank and step == args.fault_step and not marker.exists():
            marker.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            if args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "spin":
                spin_forever()
            elif args.fault == "exit13":
                os._exit(13)  # at once: an interpreter with gloo up can take seconds to exit
        dist.all_reduce(value)
        beat(step)
        time.sleep(args.sleep)
    if rank == 0:
        with open(args.out, "a", encoding="utf-8") as f:
            attempt = int(os.environ.get("TORCHVITALS_SUPERVISOR_ATTEMPT", "0"))
            record = {
                "attempt": attempt,
                "restart": restart,
                "last_step": step,
                "time": time.time(),
            }
            f.write(json.dumps(record) + "\n")
    # Out at once: a loaded machine can take seconds to tear gloo and the interpreter down,
    # which a 3 s hang timeout would take for a hang after the last step.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
