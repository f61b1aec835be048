"""Host cost per step of the agent's packed payload as the world grows (simulated world sizes).

    python benchmarks/payload.py [--worlds 2,1024,4096,16384] [--steps 100] [--rounds 5]

For each world size, one process builds the step's payload exactly as the agent packs it on a
rank of that world (the per-block sums of the benchmark GPT's 8 blocks, the loss, the per-rank
time sums, the straggler flags, the checkpoint flags, the re-run flag, the loop's skip and
double-step flags; activation maxima on every 10th step),
runs the reduction path (world size 1 here: no collective, the one host copy), unpacks the
Report, lets the rank judge itself a straggler and runs the detector over it. The collective's
wire time is not simulated (its payload is the same 40-odd floats at every world size); the
host work around it is what grew with the world before.

Beside it, ``one-hot`` replays what the agent once did: every rank's step and
compute times as two world-sized one-hot vectors in the SUM, unpacked into lists, and the
straggler rule's median of the others for every rank. Printed: microseconds per step (median of
``--rounds`` rounds of ``--steps`` steps, one in ten sampled) and the floats in an unsampled
step's SUM payload. A measurement tool: it
never judges the numbers.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch

from torchvitals.agent.detect.detector import Detector
from torchvitals.agent.detect.observed import Observed
from torchvitals.agent.detect.rules import median
from torchvitals.agent.detect.straggler import RankTiming
from torchvitals.agent.detect.thresholds import Thresholds
from torchvitals.agent.measure.activations import ActivationStats
from torchvitals.agent.measure.attention import AttentionStats
from torchvitals.agent.measure.blocks import Blocks
from torchvitals.agent.measure.datawait import DataWait
from torchvitals.agent.measure.reduce import Packer, Reducer
from torchvitals.agent.report import Report
from torchvitals.agent.signals.activations import ActivationSignal, ActivationSlots
from torchvitals.agent.signals.base import StepContext
from torchvitals.agent.signals.datawait import DataWaitSignal
from torchvitals.agent.signals.loop import LoopFlags
from torchvitals.agent.signals.loss import Loss
from torchvitals.agent.signals.timing import Timing

F64 = torch.float64
CPU = torch.device("cpu")
NAMES = ["tok_emb", "pos_emb"] + [f"blocks.{i}" for i in range(6)] + ["head", "other"]
KINDS = ["embedding", "embedding"] + ["layer"] * 6 + ["head", "other"]


class Step:
    """One simulated rank of a ``world``-rank job; ``onehot`` packs times the old way."""

    def __init__(self, world: int, onehot: bool, rank: int = 1):
        self.world, self.rank, self.onehot = world, rank, onehot
        self.detector = Detector(NAMES, KINDS)
        self.timing = Timing(RankTiming(Thresholds(), rank, world))
        self.signals = [Loss(), DataWaitSignal(DataWait()), LoopFlags(), self.timing]
        # Unpacks only: blocks that hold no module, so nothing is hooked or recorded.
        n = len(NAMES)
        no_modules = Blocks(NAMES, [[] for _ in NAMES], [None] * n, KINDS, [[] for _ in NAMES])
        self.activations = ActivationSignal(
            ActivationStats([None] * len(NAMES), 0.99),
            AttentionStats(torch.nn.Module(), no_modules),
            NAMES,
        )
        self.reducer = Reducer(None, 1)
        self.rng = random.Random(0)
        self.runs: dict[int, int] = {}
        n = len(NAMES)
        self.grad_sq = torch.rand(n, dtype=F64)
        self.act = (
            torch.rand(n, dtype=F64),
            torch.rand(5 * n, dtype=F64),
            torch.rand(n, dtype=F64),
        )

    def __call__(self, step: int) -> None:
        seconds, compute = 0.24 + 0.01 * self.rng.random(), 0.08 + 0.01 * self.rng.random()
        ctx = StepContext(
            step=step,
            sampled=step % 10 == 0,
            step_seconds=seconds,
            compute_seconds=compute,
            loss=torch.tensor(2.0 + 0.01 * self.rng.random(), dtype=F64),
            scale=None,
            device=CPU,
            world_size=self.world,
            rank=self.rank,
        )
        packer = Packer(CPU)
        packer.add_host_sum([0.0, 0.0])  # the checkpoint flags
        packer.add_host_sum([0.0])  # whether the rank can compute a suspect step again
        hot = None
        if self.onehot:
            packer.add_host_sum(self._hot(seconds))
            hot = packer.add_host_sum(self._hot(compute))
        handles = [signal.pack(ctx, packer) for signal in self.signals]
        grads = packer.add_sum(self.grad_sq)
        acts = None
        if ctx.sampled:
            counts, sums, maxes = self.act
            acts = ActivationSlots(
                packer.add_host_sum(counts.tolist()),
                packer.add_sum(sums),
                packer.add_max(maxes),
                packer.add_host_sum([0.0] * len(NAMES)),  # no attention
                packer.add_max(torch.zeros(len(NAMES), dtype=F64)),
                packer.add_max(torch.zeros(len(NAMES), dtype=F64)),
                packer.add_sum(torch.zeros(3, dtype=F64)),  # whose activations were far out
            )
        reduced = self.reducer.reduce(packer)
        if not ctx.sampled:
            self.sum_floats = reduced.sum_len  # an unsampled step's payload
        # Every rank adds its own time: the SUM of a real world, here a world of equal ranks.
        start = handles[-1].seconds.start
        reduced.host[start], reduced.host[start + 1] = seconds * self.world, compute * self.world
        report = Report(
            step=step,
            loss=math.nan,
            grad_norm={},
            grad_norm_total=0.0,
            world_size=self.world,
            rank=self.rank,
        )
        seen = Observed()
        for signal, handle in zip(self.signals, handles):
            signal.unpack(ctx, handle, reduced, report, seen)
        grad_sq = reduced[grads]
        report.grad_norm = {n: math.sqrt(v) for n, v in zip(NAMES, grad_sq)}
        report.grad_norm_total = math.sqrt(sum(grad_sq))
        if acts is not None:
            self.activations.unpack(ctx, acts, reduced, report, seen)
        if hot is not None:
            self._old_straggler(reduced[hot])
        self.detector.observe(report, seen)

    def _hot(self, value: float) -> list[float]:
        slots = [value] * self.world  # every rank's slot filled, as after the reduction
        slots[self.rank] = value
        return slots

    def _old_straggler(self, times: list[float]) -> None:
        """The rule as it once was: the median of the others, for every rank."""
        for r, v in enumerate(times):
            others = median(t for i, t in enumerate(times) if i != r)
            slow = v >= 1.5 * others and v - others >= 0.05
            self.runs[r] = self.runs.get(r, 0) + 1 if slow else 0


def per_step_us(world: int, onehot: bool, steps: int, rounds: int) -> tuple[float, int]:
    """Median microseconds per step over ``rounds``, and the floats in the SUM payload."""
    step = Step(world, onehot)
    for s in range(1, 12):
        step(s)  # warm-up: allocations, first sampled step
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
    p.add_argument(
        "--onehot-max",
        type=int,
        default=4096,
        help="largest world for the one-hot replay (its median is O(world²))",
    )
    p.add_argument(
        "--onehot-steps",
        type=int,
        default=10,
        help="its steps per round (default 10: one sampled, as in --steps 100)",
    )
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
