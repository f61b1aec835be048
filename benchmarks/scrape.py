"""The training step under a /metrics scrape flood: the rank's own server against the same bytes
served by another process.

    python benchmarks/scrape.py [--rate 300] [--clients 2] [--rounds 20] [--steps 50]
    python benchmarks/scrape.py --scrapes-per-s 0        # the limit off, as before it existed

Each rank serves /metrics from inside the training process, so whatever its server does for a
client (accepting, reading, answering, rendering) holds the training thread's GIL; a server in
another process costs the step only the CPU it takes. Times, in one run, a small CPU step
(an MLP, AdamW, one torch thread: two cores hold the step on one, the clients and the
other server on the other) in four phases:

    bare       forward, backward, optimizer.step, zero_grad, nothing watching
    idle       the same under torchvitals.watch, /metrics served and nobody scraping
    flood      ``--clients`` clients in another process scrape the rank's /metrics at ``--rate``
               scrapes a second in all (0: as fast as they can), each on a new connection
    elsewhere  the same clients against a MetricsServer in another process that serves the bytes
               the rank rendered, with the same limit (``--scrapes-per-s``, ``--burst``)

(the clients and the other server: ``benchmarks/scrapers.py``, torch-free processes)

Method: after ``--warmup`` steps each, ``--rounds`` rounds run ``--steps`` steps of every
phase, the starting phase rotated each round. A phase's time is the mean step of its round;
printed: the median over rounds, the median ratio to bare (per round) and its min-max, the
flood's cost against the rank's own server over its cost elsewhere (``flood / elsewhere``: 1.0
means the rank's server costs the step no more than a server in another process), and what the
clients got (answers by status, scrapes a second). ``serving``: the CPU the servers took, in
% of a core (median over rounds): the rank's threads but the training one, plus the other
server's process; on a machine others share, this moves less than the ratios do, and a rank's
server's share of it is time the training thread may wait for the GIL. A measurement tool: it
never judges the numbers; other processes on the machine distort them (it prints the load
average).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import nn

import torchvitals
from torchvitals.agent.tools.demo.launch import free_ports

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scrapers import ACCEPT, CLIENT_TIMEOUT_S

PHASES = ("bare", "idle", "flood", "elsewhere")
SCRAPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scrapers.py")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="interleaved timed rounds (default 20)")
    p.add_argument("--steps", type=int, default=50, help="steps per phase per round (default 50)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps per loop (default 20)")
    p.add_argument("--rate", type=float, default=300.0, help="the flood's scrapes a second")
    p.add_argument("--clients", type=int, default=2, help="the flood's clients (default 2)")
    p.add_argument("--scrapes-per-s", type=float, default=2.0, help="the limit; 0 turns it off")
    p.add_argument("--burst", type=int, default=5, help="the limit's burst")
    p.add_argument("--width", type=int, default=256, help="the MLP's width")
    p.add_argument("--depth", type=int, default=4, help="the MLP's hidden layers")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the other core is the clients' and the other server's)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    sizes = (args.rounds, args.steps, args.clients, args.width, args.depth, args.batch)
    if min(*sizes, args.threads) < 1:
        p.error("--rounds, --steps, --clients, --width, --depth, --batch, --threads must be >= 1")
    if args.warmup < 0 or args.rate < 0:
        p.error("--warmup and --rate must be >= 0")
    return args


class Loop:
    """One model and optimizer from seed 0; ``step`` trains on the next of a few fixed batches."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(args.width, args.width)]
        for _ in range(args.depth):
            layers += [nn.GELU(), nn.Linear(args.width, args.width)]
        self.model = nn.Sequential(*layers)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        self.batches = [
            (torch.randn(args.batch, args.width), torch.randn(args.batch, args.width))
            for _ in range(4)
        ]
        self.agent: Any = None
        self.done = 0

    def step(self) -> None:
        x, y = self.batches[self.done % len(self.batches)]
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        if self.agent is not None:
            self.agent.step(loss)
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.done += 1


def measure(args: argparse.Namespace) -> dict[str, Any]:
    bare, watched = Loop(args), Loop(args)
    watched.agent = torchvitals.watch(
        watched.model,
        watched.opt,
        metrics_port=free_ports(1),
        log_dir="",
        metrics_scrapes_per_s=args.scrapes_per_s,
        metrics_scrape_burst=args.burst,
    )
    exporter = watched.agent.outputs.exporter
    tmp = tempfile.mkdtemp(prefix="tv-scrape-")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        stack.callback(watched.agent.close)
        flooder = stack.enter_context(
            _helper("flood", "--clients", str(args.clients), "--rate", str(args.rate))
        )
        for _ in range(args.warmup):
            bare.step()
            watched.step()
        # The bytes the rank serves, served by another process with the same limit.
        body, content_type = exporter.cache.get(ACCEPT)
        with open(os.path.join(tmp, "metrics.txt"), "wb") as f:
            f.write(body)
        elsewhere = stack.enter_context(
            _helper(
                "serve",
                "--body",
                f.name,
                "--content-type",
                content_type,
                "--scrapes-per-s",
                str(args.scrapes_per_s),
                "--burst",
                str(args.burst),
            )
        )
        assert elsewhere.stdout is not None and flooder.stdin and flooder.stdout
        ports = {"flood": exporter.port, "elsewhere": int(elsewhere.stdout.readline())}
        server_process = psutil.Process(elsewhere.pid)
        times: dict[str, list[float]] = {p: [] for p in PHASES}
        serving: dict[str, list[float]] = {p: [] for p in PHASES}
        answers: dict[str, Counter[str]] = {p: Counter() for p in ports}
        rates: dict[str, list[float]] = {p: [] for p in ports}
        for r in range(args.rounds):
            for phase in PHASES[r % len(PHASES) :] + PHASES[: r % len(PHASES)]:
                loop = bare if phase == "bare" else watched
                if phase in ports:
                    flooder.stdin.write(f"{ports[phase]}\n")
                    flooder.stdin.flush()
                    assert flooder.stdout.readline().strip() == "started"
                cpu, own, child = time.process_time(), time.thread_time(), _cpu(server_process)
                began = time.perf_counter()
                for _ in range(args.steps):
                    loop.step()
                wall = time.perf_counter() - began
                times[phase].append(wall / args.steps)
                # CPU the rank's other threads (its /metrics server) and the other server took.
                rank = (time.process_time() - cpu) - (time.thread_time() - own)
                serving[phase].append(max(0.0, rank + _cpu(server_process) - child) / wall)
                if phase in ports:
                    flooder.stdin.write("stop\n")
                    flooder.stdin.flush()
                    got = json.loads(flooder.stdout.readline())
                    answers[phase].update(got["answers"])
                    rates[phase].append(sum(got["answers"].values()) / got["seconds"])
    return {
        "times": times,
        "serving_cpu": {p: statistics.median(c) for p, c in serving.items()},
        "answers": {p: dict(a) for p, a in answers.items()},
        "scrapes_per_s": {p: statistics.median(r) for p, r in rates.items()},
        "renders": exporter.cache.renders,
        "body_bytes": len(body),
    }


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


@contextlib.contextmanager
def _helper(*argv: str) -> Iterator[subprocess.Popen[str]]:
    """``scrapers.py`` in a process of its own, talked to through its stdin and stdout; ended
    by closing its stdin."""
    proc = subprocess.Popen(
        [sys.executable, SCRAPERS, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(CLIENT_TIMEOUT_S + 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def summarize(times: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Median step time, and the median and range of per-round ratios to bare."""
    out: dict[str, dict[str, Any]] = {}
    for phase, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times["bare"])]
        out[phase] = {
            "step_ms": 1e3 * statistics.median(ts),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    limit = (
        f"{args.scrapes_per_s:g} scrapes/s per client address, burst {args.burst}"
        if args.scrapes_per_s
        else "off"
    )
    rate = f"{args.rate:g}/s" if args.rate else "back to back"
    print(
        f"MLP {args.depth}x{args.width}, batch {args.batch}, torch threads "
        f"{torch.get_num_threads()}; flood: {args.clients} clients, {rate}; limit: {limit}; "
        f"{args.rounds} rounds x {args.steps} steps",
        flush=True,
    )
    load = os.getloadavg()[0]
    result = measure(args)
    summary = summarize(result["times"])
    print(
        f"{'phase':<10} {'step ms':>8} {'ratio':>6} {'min-max':>11} {'serving':>8}  "
        f"{'scrapes/s':>9}  answers"
    )
    for phase, row in summary.items():
        got = result["answers"].get(phase)
        print(
            f"{phase:<10} {row['step_ms']:>8.2f} {row['ratio']:>6.2f} "
            f"{row['ratio_min']:>5.2f}-{row['ratio_max']:<5.2f} "
            f"{100 * result['serving_cpu'][phase]:>7.1f}%  "
            + (f"{result['scrapes_per_s'][phase]:>9.0f}  {got}" if got is not None else "")
        )
    per_round = [f / e for f, e in zip(result["times"]["flood"], result["times"]["elsewhere"])]
    print(
        f"flood / elsewhere: {statistics.median(per_round):.2f} "
        f"(per round {min(per_round):.2f}-{max(per_round):.2f}); the rank rendered "
        f"{result['renders']} times ({result['body_bytes']} bytes); load average before "
        f"{load:.2f}, after {os.getloadavg()[0]:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, **result}, f, indent=1)


if __name__ == "__main__":
    main()
