"""``torchvitals demo``: spawn the CPU ranks, watch them, write the run report.

    torchvitals demo                          # 2 gloo ranks, LR spike mid-run, report at the end
    torchvitals demo --fault nan --steps 120 --out /tmp/tv-demo

The ranks are spawned processes on this machine (gloo on 127.0.0.1, free ports), so the demo
needs no server and no launcher. This process only watches them: when a rank dies, the others
would wait in a collective until gloo's timeout, so it stops them at once and exits 1 naming the
rank; a job past ``timeout_s`` is stopped the same way.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TextIO

from ....errors import TorchvitalsError
from .ports import HOST, free_ports
from .train import DemoRun, train


class RankFailed(TorchvitalsError, RuntimeError):
    """A rank exited non-zero or was killed; the message names it and how."""


def _rank_main(rank: int, world: int, master_port: int, run: DemoRun) -> None:
    """A spawned rank: join the gloo world, train, leave with the exit status."""
    os.environ.update(
        MASTER_ADDR=HOST,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        try:
            train(rank, world, run)
        finally:
            dist.destroy_process_group()
    except SystemExit as exc:  # TrainingAborted: the loop guard's exit code
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # any failure ends this rank with its traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: destroying gloo/DDP objects after a peer left can abort (SIGABRT)
    # and hide the real exit status.
    os._exit(code)


def wait_ranks(
    procs: list[Any],
    timeout_s: float,
    grace_s: float = 5.0,
    poll_s: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Wait for every rank; stop the others as soon as one fails.

    Args:
        procs: the rank processes (``multiprocessing.Process``), index = rank.
        timeout_s: the whole job's limit.
        grace_s: how long the others get to exit on their own after one exits non-zero (an
            abort reaches every rank in the same step) before they are killed.
        poll_s: polling interval.
        clock: seconds.

    Raises:
        RankFailed: a rank exited non-zero or by a signal, or the job ran past ``timeout_s``;
            every rank still alive has been killed.
    """
    deadline = clock() + timeout_s
    failed_at: float | None = None
    failure = ""
    try:
        while any(p.is_alive() for p in procs):
            now = clock()
            for rank, p in enumerate(procs):
                if p.exitcode not in (None, 0) and failed_at is None:
                    failed_at, failure = now, describe_exit(rank, p.exitcode)
            if failed_at is not None and now - failed_at > grace_s:
                break
            if now > deadline:
                failure = f"the ranks did not finish within {timeout_s:g} s"
                break
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
    if not failure:
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        failure = describe_exit(*bad[0]) if bad else ""
    if failure:
        raise RankFailed(failure)


def describe_exit(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with status {code}"


def run_demo(
    run: DemoRun, world: int = 2, timeout_s: float = 600.0, stream: TextIO | None = None
) -> int:
    """Train ``world`` ranks with the fault, then write and print the report.

    Args:
        run: what to train (``run.metrics_port`` 0 picks free ports).
        world: ranks.
        timeout_s: stop the job past this many seconds.
        stream: where the launcher's own lines go (default: stdout).

    Returns:
        The exit status: 0 done, 1 a rank failed (the message names it).
    """
    out = stream or sys.stdout
    os.makedirs(run.out, exist_ok=True)
    if run.metrics_port == 0:
        run.metrics_port = free_ports(world)
    master_port = free_ports(1)
    say = lambda line: (out.write(line + "\n"), out.flush())  # noqa: E731
    say(
        f"torchvitals demo: {world} CPU ranks (gloo) train a small GPT on Shakespeare's sonnets "
        f"for {run.steps} steps; fault: {run.fault}"
        + (f" after step {run.fault_step}" if run.fault != "none" else "")
    )
    for rank in range(world):
        say(f"  rank {rank} metrics: curl -s http://{HOST}:{run.metrics_port + rank}/metrics")
    say(f"  run folder: {run.out}")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, master_port, run)) for r in range(world)
    ]
    started = time.monotonic()
    for p in procs:
        p.start()
    try:
        wait_ranks(procs, timeout_s)
    except RankFailed as exc:
        say(
            f"torchvitals demo: {exc}; the other ranks were stopped. The event log and the "
            f"ledger so far are in {run.out}."
        )
        return 1
    except KeyboardInterrupt:
        say("torchvitals demo: interrupted; the ranks were stopped.")
        return 130
    say(f"training done in {time.monotonic() - started:.0f} s; writing the report ...")
    from ..runreport import write_report

    with open(os.path.join(run.out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)  # rank 0's account of the run (demo/train.py)
    fault = summary["run"]
    report = write_report(
        run.out,
        healthy_at_end=bool(summary["healthy_at_end"]),
        facts=[("injected fault", f"{fault['fault']} after step {fault.get('fault_step')}")],
    )
    say(report.render_summary())
    say(f"report: {report.html}")
    return 0
