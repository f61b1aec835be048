"""Per-step overhead of torchvitals and of the alternatives, as ratios to the bare training loop.

    python benchmarks/overhead.py

Times, in one run, single process (default torch threads) and DDP world size 2 on gloo
(spawned ranks, one torch thread each, so two ranks share two cores):

    bare      forward, backward, optimizer.step, zero_grad
    default   torchvitals.watch(model, opt, metrics_port=0, log_dir="")   (the measuring path)
    export    the same with the Prometheus exporter and the event log on (never scraped)
    every     every signal every step (sample_every=1)
    watchdog  default + the watchdog (checkpoint_every=50): staged, written in the background
    watchsync the same with synchronous saves (snapshot_max_bytes=0): no staged copy
    naive     hand-written per-parameter/per-block .item() statistics, every step
    wandb     wandb.watch(model, log="all", log_freq=1) in an offline run (skipped, with the
              reason, when wandb does not import; pip install wandb)

Model: TinyGPT(vocab=256, d_model=256, n_layers=6, n_heads=4, seq_len=128), batch 8, AdamW
(foreach), seed 0; under DDP every rank runs the same variant at the same time and the agent
wraps the DDP module.

Method: each variant keeps one model, optimizer and monitor for the whole run (built once from
the same seed, so setup is never timed). After ``--warmup`` steps each, ``--rounds`` rounds
run ``--steps`` consecutive steps of every variant, round-robin, with the starting variant
rotated each round, so drift and position effects hit all variants alike. A round's time for a
variant is the mean of its steps; under DDP, the slower rank's. Keep ``--steps`` a multiple of
the agent's sample_every (10) so every round holds the same number of sampled steps. Reported:
the median round time, the ratio to bare (median over rounds of round time / bare's round time
in the same round) and the min-max of those per-round ratios. Below it, for each agent variant,
the agent's own host time per step (``agent.stage_times``), median µs per stage (measure,
reduce, detect, decide/act without the optimizer's own step, publish) and per step kind
(unsampled, sampled, checkpoint), next to the bare step's time: a change of 1% is visible
there when whole-step ratios (±5% per round here) cannot show it; on CUDA a column counts the
host syncs per step (torch's sync debug mode, after the timed rounds). A measurement tool: it
never judges the numbers.

The watchdog variants save every 50 steps: time them with ``--steps 50`` (one save per round),
e.g. ``python benchmarks/overhead.py --modes single --variants default,watchdog,watchsync
--rounds 6 --steps 50``; the stall per save and one rollback from memory and from disk are
printed below the table.

The defaults take about 7 minutes on a quiet 2-core machine (bare step ~240 ms single, ~430 ms
DDP). The wandb run stays open for the whole mode; its idle background threads (~0.03 of a core)
run during every variant alike. Other processes on the machine distort everything, and with two
torch threads on two cores a single busy neighbour can slow a step several-fold: the script
reports how many cores other processes used during each mode, and warns when it was not quiet.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue as queue_module
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

from torchvitals.agent.tools.demo.data import random_batches

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variants import DESCRIPTIONS, VARIANTS, Watchdog, build, wandb_missing

from torchvitals.agent.step import StageTimes

MODEL = dict(vocab=256, d_model=256, n_layers=6, n_heads=4, seq_len=128)
SMALL = dict(vocab=64, d_model=32, n_layers=2, n_heads=4, seq_len=16)
BATCH, SMALL_BATCH = 8, 2
POOL = 8
"""Distinct batches per rank, cycled: generated up front so data making is never timed."""
JOIN_TIMEOUT_S = 1800


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9, help="interleaved timed rounds (default 9)")
    p.add_argument(
        "--steps",
        type=int,
        default=10,
        help="timed steps per variant per round; a multiple of 10 (default 10)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (default 3)")
    p.add_argument("--modes", default="single,ddp", help="comma list of single, ddp")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma list of {', '.join(VARIANTS)}; bare is always added",
    )
    p.add_argument("--small", action="store_true", help="a tiny model (smoke tests)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument(
        "--sync-steps",
        type=int,
        default=10,
        help="steps per variant counted for host syncs on CUDA (default 10)",
    )
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    names = [v for v in args.variants.split(",") if v]
    for bad in [m for m in args.modes if m not in ("single", "ddp")] + [
        v for v in names if v not in VARIANTS
    ]:
        p.error(f"unknown mode or variant {bad!r}")
    args.variants = ["bare"] + [v for v in VARIANTS if v in names and v != "bare"]
    if min(args.rounds, args.steps) < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0")
    return args


def free_port_pair() -> int:
    """A port p with p and p + 1 free: the exporter serves on base + LOCAL_RANK."""
    from torchvitals.agent.tools.demo.launch import free_ports

    return free_ports(2)


def measure(args: argparse.Namespace, *, rank: int, world: int, port: int) -> dict[str, Any]:
    """Build the variants, warm them up, run the interleaved rounds; this rank's round times."""
    ddp = world > 1
    model_kwargs = SMALL if args.small else MODEL
    batch = SMALL_BATCH if args.small else BATCH
    skipped: dict[str, str] = {}
    missing = wandb_missing() if "wandb" in args.variants else None
    if missing:
        skipped["wandb"] = missing
    names = [v for v in args.variants if v not in skipped]
    batches = list(
        random_batches(POOL, batch, model_kwargs["seq_len"], model_kwargs["vocab"], seed=rank)
    )
    tmp = tempfile.mkdtemp(prefix=f"tv-overhead-r{rank}-")
    # The checkpoints' folder must be the same on every rank: named after the shared port.
    shared = os.path.join(tempfile.gettempdir(), f"tv-overhead-ckpt-{port}")
    runs = {
        v: build(v, model_kwargs, ddp=ddp, rank=rank, tmp=tmp, port=port, shared=shared)
        for v in names
    }
    done = dict.fromkeys(names, 0)

    def run_steps(v: str, n: int) -> None:
        for _ in range(n):
            runs[v].step(*batches[done[v] % POOL])
            done[v] += 1

    try:
        for _ in range(args.warmup):
            for v in names:
                run_steps(v, 1)
        for run in runs.values():
            if hasattr(run, "agent"):
                run.agent.stage_times = StageTimes()
        times: dict[str, list[float]] = {v: [] for v in names}
        for r in range(args.rounds):
            for v in names[r % len(names) :] + names[: r % len(names)]:
                if ddp:
                    dist.barrier()
                start = time.perf_counter()
                run_steps(v, args.steps)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                if ddp:
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[v].append(elapsed.item() / args.steps)
        stages = {
            v: stage_summary(r.agent.stage_times) for v, r in runs.items() if hasattr(r, "agent")
        }
        syncs = count_syncs(runs, run_steps, args.sync_steps) if torch.cuda.is_available() else {}
    finally:
        for run in runs.values():
            run.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if ddp:
            dist.barrier()
        if rank == 0:
            shutil.rmtree(shared, ignore_errors=True)
    saves = {
        v: {"stalls": r.stalls, "restore_s": r.restore_s}
        for v, r in runs.items()
        if isinstance(r, Watchdog)
    }
    return {"times": times, "skipped": skipped, "saves": saves, "stages": stages, "syncs": syncs}


def stage_summary(stage_times: Any) -> dict[str, dict[str, float]]:
    """kind -> stage -> median µs of the agent's own host time (and ``steps``: how many)."""
    out = {}
    for kind, stages in stage_times.samples.items():
        row = {stage: 1e6 * statistics.median(values) for stage, values in stages.items() if values}
        row["total"] = sum(row.values())
        row["steps"] = len(next(iter(stages.values())))
        out[kind] = row
    return out


def count_syncs(runs: dict[str, Any], run_steps: Any, steps: int) -> dict[str, float]:
    """Host syncs per step of each variant on CUDA (torch's sync debug mode warns at each),
    counted after the timed rounds, over ``steps`` steps (a multiple of 10: sampled included)."""
    import warnings

    out = {}
    for v in runs:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run_steps(v, steps)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out[v] = sum("synchroniz" in str(w.message) for w in seen) / steps
    return out


def print_stages(
    mode: str, summary: dict[str, dict[str, Any]], stages: dict[str, Any], syncs: dict[str, float]
) -> None:
    """The agent's own host time per stage and step kind, in µs, beside the bare step's."""
    if not stages:
        return
    bare_us = 1e3 * summary["bare"]["step_ms"]
    print(
        f"\n{mode}: the agent's own host time per step, median µs by stage (bare step "
        f"{bare_us:.0f} µs; act excludes the optimizer's own step)"
    )
    cols = ("measure", "reduce", "detect", "act", "publish", "total")
    print(
        f"{'variant':<9} {'kind':<11} {'steps':>5} "
        + " ".join(f"{c:>8}" for c in cols)
        + f" {'% bare':>7}"
        + (f" {'syncs':>6}" if syncs else "")
    )
    for v, kinds in stages.items():
        for kind in ("unsampled", "sampled", "checkpoint"):
            row = kinds.get(kind)
            if row is None:
                continue
            print(
                f"{v:<9} {kind:<11} {row['steps']:>5} "
                + " ".join(f"{row.get(c, float('nan')):>8.0f}" for c in cols)
                + f" {100 * row['total'] / bare_us:>6.2f}%"
                + (f" {syncs.get(v, float('nan')):>6.1f}" if syncs else "")
            )
    if syncs:
        print(f"(syncs: host syncs per whole step on CUDA, bare {syncs.get('bare', 0):.1f})")


def summarize(times: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Median round time, and the median and range of per-round ratios to bare."""
    bare = times["bare"]
    out = {}
    for v, ts in times.items():
        ratios = [t / b for t, b in zip(ts, bare)]
        out[v] = {
            "step_ms": 1e3 * statistics.median(ts),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "round_ms": [1e3 * t for t in ts],
            "round_ratios": ratios,
        }
    return out


def _ddp_rank(
    rank: int, world: int, args: argparse.Namespace, master: int, port: int, queue: Any
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)  # two ranks on two cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
        try:
            result = measure(args, rank=rank, world=world, port=port)
        finally:
            dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_ddp(args: argparse.Namespace, world: int = 2) -> dict[str, Any]:
    """Spawn ``world`` gloo ranks running ``measure``; rank 0's result (times are the max)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    master = free_port_pair()
    port = free_port_pair()
    procs = [
        ctx.Process(target=_ddp_rank, args=(r, world, args, master, port, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while len(results) < world:
            try:
                rank, status, payload = queue.get(timeout=5)
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"DDP ranks died (exit codes {dead}) or hung") from None
                continue
            if status != "ok":
                raise RuntimeError(f"DDP rank {rank} failed:\n{payload}")
            results[rank] = payload
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return results[0]


def cpu_sample() -> tuple[float, float, float, float]:
    """(wall s, machine busy CPU s, hypervisor steal s, CPU s of this process and its reaped
    children): the difference of two samples tells how much CPU other processes took."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    own = sum(
        r.ru_utime + r.ru_stime
        for r in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )
    return time.perf_counter(), busy, getattr(t, "steal", 0.0), own


def contention(before: tuple[float, ...], after: tuple[float, ...]) -> dict[str, float]:
    """Average cores used by other processes and stolen by the hypervisor between two samples."""
    wall, busy, steal, own = (a - b for a, b in zip(after, before))
    return {"wall_s": wall, "other_cores": max(0.0, busy - own) / wall, "steal_cores": steal / wall}


def print_table(mode: str, summary: dict[str, dict[str, Any]], skipped: dict[str, str]) -> None:
    print(f"\n{'mode':<7} {'variant':<8} {'step ms':>8} {'ratio':>7} {'min-max':>13}  what")
    for v, s in summary.items():
        print(
            f"{mode:<7} {v:<8} {s['step_ms']:>8.1f} {s['ratio']:>7.3f} "
            f"{s['ratio_min']:>6.3f}-{s['ratio_max']:<6.3f}  {DESCRIPTIONS[v]}"
        )
    for v, reason in skipped.items():
        print(f"{mode:<7} {v:<8} skipped: {reason}")


def print_saves(
    mode: str, summary: dict[str, dict[str, Any]], saves: dict[str, Any], every: int = 50
) -> None:
    """Each watchdog variant's stall per save, in ms and in steps of the bare loop, the share of
    training time it costs at one save per ``every`` steps, and one rollback from memory/disk."""
    if not saves:
        return
    bare_ms = summary["bare"]["step_ms"]
    for v, s in saves.items():
        if not s["stalls"]:
            print(f"{mode:<7} {v:<9} no checkpoint was due (run >= 50 steps per variant)")
            continue
        stall = 1e3 * statistics.median(s["stalls"])
        rollback = ", ".join(
            f"from {k} {1e3 * t:.1f} ms ({1e3 * t / bare_ms:.2f} steps)"
            for k, t in s["restore_s"].items()
        )
        print(
            f"{mode:<7} {v:<9} {len(s['stalls'])} saves, stall per save {stall:.1f} ms = "
            f"{stall / bare_ms:.3f} steps of {bare_ms:.0f} ms, "
            f"{100 * stall / (every * bare_ms):.2f}% of training time; rollback {rollback}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = SMALL if args.small else MODEL
    print(
        f"torchvitals overhead: torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus; model {model}, batch {SMALL_BATCH if args.small else BATCH}; "
        f"{args.rounds} rounds x {args.steps} steps, warmup {args.warmup}",
        flush=True,
    )
    if args.steps % 10:
        print(
            "note: --steps is not a multiple of sample_every (10): rounds hold unequal "
            "numbers of sampled steps",
            flush=True,
        )
    began = time.perf_counter()
    report: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "model": model,
        "torch": torch.__version__,
        "modes": {},
    }
    for mode in args.modes:
        before = cpu_sample()
        if mode == "single":
            result = measure(args, rank=0, world=1, port=free_port_pair())
            threads = torch.get_num_threads()
        else:
            result = run_ddp(args)
            threads = 1
        load = contention(before, cpu_sample())
        summary = summarize(result["times"])
        print_table(mode, summary, result["skipped"])
        print_saves(mode, summary, result.get("saves", {}))
        print_stages(mode, summary, result.get("stages", {}), result.get("syncs", {}))
        print(
            f"({mode}: {threads} torch thread(s) per process, {load['wall_s']:.0f} s; other "
            f"processes used {load['other_cores']:.2f} of {os.cpu_count()} cores on average, "
            f"hypervisor steal {load['steal_cores']:.2f})",
            flush=True,
        )
        if load["other_cores"] + load["steal_cores"] > 0.1:
            print(
                f"warning: the machine was not quiet during {mode}; these ratios measure "
                "contention as much as overhead",
                flush=True,
            )
        report["modes"][mode] = {
            "threads": threads,
            "load": load,
            "variants": summary,
            "skipped": result["skipped"],
            "saves": result.get("saves", {}),
            "stages": result.get("stages", {}),
            "syncs": result.get("syncs", {}),
        }
    report["wall_s"] = time.perf_counter() - began
    print(f"\ntotal wall time {report['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
