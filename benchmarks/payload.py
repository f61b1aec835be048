"""Host cost per step of the agent's packed payload as the world grows (simulated world sizes).

    python benchmarks/payload.py [--worlds 2,1024,4096,16384] [--steps 100] [--rounds 5]

For each world size, one process builds the step's payload exactly as the agent packs it on a
rank of that world (the per-block sums of the benchmark GPT's 8 blocks, the loss, the per-rank
time sums, the straggler flags, the checkpoint flags; activation maxima on every 10th step),
runs the reduction path (world size 1 here: no collective, the one host copy), unpacks the
Report, lets the rank judge itself a straggler and runs the detector over it. The collective's
wire time is not simulated (its payload is the same 40-odd floats at every world size); the
host work around it is what grew with the world before.

Beside it, ``one-hot`` replays what the agent did before issue 14: every rank's step and
compute times as two world-sized one-hot vectors in the SUM, unpacked into lists, and the
straggler rule's median of the others for every rank. Printed: microseconds per step (median of
``--rounds`` rounds of ``--steps`` steps, one in ten sampled) and the floats in an unsampled
step's SUM payload. A measurement tool: it
never judges the numbers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from torchvitals.agent.detect.detector import Detector
from torchvitals.agent.detect.rules import median
from torchvitals.agent.detect.straggler import RankTiming
from torchvitals.agent.detect.thresholds import Thresholds
from torchvitals.agent.measure.loss import LossBook
from torchvitals.agent.measure.reduce import Packer, Reducer, unpack

F64 = torch.float64
NAMES = ["tok_emb", "pos_emb"] + [f"blocks.{i}" for i in range(6)] + ["head", "other"]
KINDS = ["embedding", "embedding"] + ["layer"] * 6 + ["head", "other"]


class Step:
    """One simulated rank of a ``world``-rank job; ``onehot`` packs times the old way."""

    def __init__(self, world: int, onehot: bool, rank: int = 1):
        self.world, self.rank, self.onehot = world, rank, onehot
        self.detector = Detector(NAMES, KINDS)
        self.timing = RankTiming(Thresholds(), rank, world)
        self.reducer = Reducer(None, 1)
        self.rng = random.Random(0)
        self.runs: dict[int, int] = {}
        n = len(NAMES)
        self.grad_sq = torch.rand(n, dtype=F64)
        self.act = (torch.rand(n, dtype=F64), torch.rand(5 * n, dtype=F64), torch.rand(n, dtype=F64))

    def __call__(self, step: int) -> None:
        seconds, compute = 0.24 + 0.01 * self.rng.random(), 0.08 + 0.01 * self.rng.random()
        packer = Packer(torch.device("cpu"))
        packer.add_host_sum("checkpoint", [0.0, 0.0])
        if self.onehot:
            packer.add_host_sum("rank_step_seconds", self._hot(seconds))
            packer.add_host_sum("rank_compute_seconds", self._hot(compute))
        packer.add_host_sum("rank_seconds", [seconds, compute])
        packer.add_host_sum("straggler", self.timing.flags())
        packer.add_sum("grad_sq", self.grad_sq)
        LossBook.pack(packer, torch.tensor(2.0 + 0.01 * self.rng.random(), dtype=F64),
                      torch.device("cpu"))
        packer.add_host_sum("data_wait", [0.0, seconds])      # the vitals' two floats
        if step % 10 == 0:
            counts, sums, maxes = self.act
            packer.add_host_sum("act_count", counts.tolist())
            packer.add_sum("act_sums", sums)
            packer.add_max("act_max", maxes)
            packer.add_host_sum("attn_count", [0.0] * len(NAMES))    # no attention modules
            packer.add_max("attn_neg_entropy", torch.zeros(len(NAMES), dtype=F64))
            packer.add_max("attn_logit", torch.zeros(len(NAMES), dtype=F64))
        layout, host = self.reducer.reduce(packer)
        if step % 10:
            self.sum_floats = layout.sum_len      # an unsampled step's payload
        # Every rank adds its own time: the SUM of a real world, here a world of equal ranks.
        start, _ = layout.sections["rank_seconds"]
        host[start], host[start + 1] = seconds * self.world, compute * self.world
        report = unpack(layout, host, step=step, names=NAMES, world_size=self.world,
                        rank=self.rank, pending=None)
        self.timing.observe(compute, report.mean_compute_seconds * self.world)
        extra = {"straggler": layout.get(host, "straggler")}
        if self.onehot:
            self._old_straggler(layout.get(host, "rank_compute_seconds"))
        self.detector.observe(report, extra)

    def _hot(self, value: float) -> list[float]:
        slots = [value] * self.world      # every rank's slot filled, as after the reduction
        slots[self.rank] = value
        return slots

    def _old_straggler(self, times: list[float]) -> None:
        """The rule before issue 14: the median of the others, for every rank."""
        for r, v in enumerate(times):
            others = median(t for i, t in enumerate(times) if i != r)
            slow = v >= 1.5 * others and v - others >= 0.05
            self.runs[r] = self.runs.get(r, 0) + 1 if slow else 0


def per_step_us(world: int, onehot: bool, steps: int, rounds: int) -> tuple[float, int]:
    """Median microseconds per step over ``rounds``, and the floats in the SUM payload."""
    step = Step(world, onehot)
    for s in range(1, 12):
        step(s)                                   # warm-up: allocations, first sampled step
    times = []
    n = 12
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            step(n)
            n += 1
        times.append((time.perf_counter() - start) / steps * 1e6)
    return statistics.median(times), step.sum_floats


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,1024,4096,16384")
    p.add_argument("--steps", type=int, default=100, help="steps per round (default 100)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--onehot-max", type=int, default=4096,
                   help="largest world for the one-hot replay (its median is O(world²))")
    p.add_argument("--onehot-steps", type=int, default=10,
                   help="its steps per round (default 10: one sampled, as in --steps 100)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'world':>7} {'payload':>8} {'us/step':>9}   {'one-hot payload':>15} {'us/step':>11}")
    for world in (int(w) for w in args.worlds.split(",")):
        us, floats = per_step_us(world, False, args.steps, args.rounds)
        old = "skipped (O(world²) median)"
        if world <= args.onehot_max:
            old_us, old_floats = per_step_us(world, True, args.onehot_steps, args.rounds)
            old = f"{old_floats:>15} {old_us:>11.0f}"
        print(f"{world:>7} {floats:>8} {us:>9.1f}   {old}", flush=True)


if __name__ == "__main__":
    main()
