"""Stragglers without a world-sized payload: each rank judges itself, the reduction says who.

Every step each rank adds its own step and compute times to the step's SUM vector (two floats,
whatever the world size), so after the reduction each rank knows its own compute time (locally)
and the sum over all ranks, hence the mean of the others. A rank whose compute time stays at
least ``straggler_factor`` times the others' mean (and ``straggler_min_seconds`` above it) for
``straggler_steps`` steps raises its flag, and its flag rides the next step's SUM as
``[1, rank, rank², seconds, others' mean, steps]``. The sum of the flags, identical on every
rank, names one slow rank exactly (its rank is the sum), two exactly (from the sums of ranks and
of their squares), and counts more. The verdict comes one step after the rank judged itself,
the price of not sending every rank's time to every rank (at 16,384 ranks that was 32,768
floats per step, reduced and unpacked on the host).

The others' mean stands in for their median: a lone straggler barely moves the mean of many
ranks, and the median needs every value.
"""

from __future__ import annotations

import math

from .thresholds import Thresholds

SLOTS = 6
"""Floats a rank adds to the SUM: flag, rank, rank², seconds, others' mean, steps."""


class RankTiming:
    """This rank's side: its run of slow steps and its flag for the next reduction.

    Args:
        t: the detection thresholds (``straggler_*``).
        rank: this rank in the reduction's group.
        world_size: ranks in the group.
    """

    def __init__(self, t: Thresholds, rank: int, world_size: int):
        self.t, self.rank, self.world_size = t, rank, world_size
        self.run = 0
        self._flag = [0.0] * SLOTS

    def flags(self) -> list[float]:
        """What this rank adds to the step's SUM (zeros unless it is a straggler)."""
        return self._flag

    def observe(self, own_seconds: float, total_seconds: float) -> None:
        """Judge this rank's compute time of the step against the mean of the others'.

        Args:
            own_seconds: this rank's compute time of the step.
            total_seconds: the sum over every rank (from the reduction).
        """
        if self.world_size < 2:
            return
        others = (total_seconds - own_seconds) / (self.world_size - 1)
        slow = (own_seconds >= self.t.straggler_factor * others
                and own_seconds - others >= self.t.straggler_min_seconds)
        self.run = self.run + 1 if slow else 0
        r = float(self.rank)
        self._flag = ([1.0, r, r * r, own_seconds, others, float(self.run)]
                      if self.run >= self.t.straggler_steps else [0.0] * SLOTS)


def slow_ranks(summed: list[float]) -> tuple[int, list[int | None]]:
    """How many ranks flagged themselves and which, from the reduced flags.

    Returns:
        ``(count, ranks)``: ``ranks`` names one or two ranks exactly; with three or more it is
        ``[None]`` (their own ``compute_duration_seconds`` series tell them apart).
    """
    count = round(summed[0])
    if count <= 0:
        return 0, []
    if count == 1:
        return 1, [round(summed[1])]
    if count == 2:
        # r1 + r2 = s and r1² + r2² = q  =>  r1, r2 = (s ∓ sqrt(2q - s²)) / 2
        s, q = summed[1], summed[2]
        d = math.sqrt(max(2.0 * q - s * s, 0.0))
        return 2, [round((s - d) / 2), round((s + d) / 2)]
    return count, [None]
