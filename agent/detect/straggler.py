"""Stragglers without a world-sized payload: each rank judges itself, the reduction says who.

Every step each rank adds its own step and compute times to the step's SUM vector (two floats,
whatever the world size), so after the reduction each rank knows its own compute time (locally)
and the sum over all ranks, hence the mean of the others. A rank whose compute time stays at
least ``straggler_factor`` times the others' mean (and ``straggler_min_seconds`` above it) for
``straggler_steps`` steps raises its flag, and its flag rides the next step's SUM as
``[1, rank, rank², seconds, others' mean, steps, data wait, communication]`` (its own wait for
its batch, so the verdict can say whether data or compute made it slow). A rank whose compute
time is normal but whose whole step time stays as far above the others' is slow after its
forward pass, where the backward's collectives are: it flags itself with ``communication`` 1 and
its step times in ``seconds`` and ``others' mean``. (Under DDP the backward's all-reduce makes
every rank wait for the slowest, so the step times agree and this rarely fires; it does where
the ranks synchronise only in the agent's reduction.) The sum of the flags, identical on every
rank, names one slow rank exactly (its rank is the sum), two exactly (from the sums of ranks and
of their squares), and counts more. The verdict comes one step after the rank judged itself,
the price of not sending every rank's time to every rank (at 16,384 ranks that was 32,768
floats per step, reduced and unpacked on the host).

The others' mean stands in for their median: a lone straggler barely moves the mean of many
ranks, and the median needs every value.
"""

from __future__ import annotations

import dataclasses

from ..measure import ranksum
from .rules import Rule
from .thresholds import Thresholds
from .verdict import STRAGGLER, WARNING, Verdict

SLOTS = 8
"""Floats a rank adds to the SUM: flag, rank, rank², seconds, others' mean, steps, data wait,
communication."""


class RankTiming:
    """This rank's side: its run of slow steps and its flag for the next reduction.

    Args:
        t: the detection thresholds (``straggler_*``).
        rank: this rank in the reduction's group.
        world_size: ranks it is judged among (the group, or its pipeline stage's ranks).
    """

    def __init__(self, t: Thresholds, rank: int, world_size: int):
        self.t, self.rank, self.world_size = t, rank, world_size
        self.run = 0
        self._flag = [0.0] * SLOTS

    def flags(self) -> list[float]:
        """What this rank adds to the step's SUM (zeros unless it is a straggler)."""
        return self._flag

    def observe(
        self,
        own_seconds: float,
        total_seconds: float,
        data_wait: float = 0.0,
        step: tuple[float, float] | None = None,
    ) -> None:
        """Judge this rank's compute time of the step against the mean of the others'.

        Args:
            own_seconds: this rank's compute time of the step.
            total_seconds: the sum over the ranks it is judged among (from the reduction).
            data_wait: this rank's wait for its batch in the step (part of its compute time).
            step: this rank's whole step time and the others' mean of theirs, judged when its
                compute time is not slow (None: compute only).
        """
        if self.world_size < 2:
            return
        others = (total_seconds - own_seconds) / (self.world_size - 1)
        judged, communication = (own_seconds, others), 0.0
        if not self._slow(own_seconds, others) and step is not None and self._slow(*step):
            judged, communication = step, 1.0
        slow = self._slow(*judged)
        self.run = self.run + 1 if slow else 0
        self._flag = (
            [*ranksum.encode(self.rank, 1.0), *judged, float(self.run), data_wait, communication]
            if self.run >= self.t.straggler_steps
            else [0.0] * SLOTS
        )

    def _slow(self, own: float, others: float) -> bool:
        return (
            own >= self.t.straggler_factor * others and own - others >= self.t.straggler_min_seconds
        )


def slow_ranks(summed: list[float]) -> tuple[int, list[int | None]]:
    """How many ranks flagged themselves and which, from the reduced flags.

    Returns:
        ``(count, ranks)``: ``ranks`` names one or two ranks exactly; with three or more it is
        ``[None]`` (their own ``compute_duration_seconds`` series tell them apart).
    """
    count, named = ranksum.decode(*summed[: ranksum.SLOTS])
    return count, ([None] if count > 2 else list(named))


class Straggler(Rule):
    """Ranks whose compute time stayed well above the others' mean (each judged itself): the
    reduced flags name them the same way on every rank."""

    patterns = (STRAGGLER,)

    def __init__(self, t: Thresholds):
        self.t = t

    def observe(self, report, seen):
        flags = seen.straggler_flags
        if not flags:
            return []
        count, ranks = slow_ranks(flags)
        if count == 0:
            return []
        # Exact for one rank; the mean over the flagged ranks otherwise.
        evidence = {
            "seconds": flags[3] / count,
            "others_mean": flags[4] / count,
            "steps": int(flags[5] / count),
            "slow_ranks": count,
            "fired": "straggler_factor",
            "straggler_factor": self.t.straggler_factor,
        }
        communication = len(flags) >= SLOTS and flags[7] / count >= 0.5
        return [
            straggler_cause(
                Verdict(STRAGGLER, WARNING, report.step, None, dict(evidence, rank=r)),
                flags[6] / count,
                communication=communication,
            )
            for r in ranks
        ]


def straggler_cause(
    verdict: Verdict, data_wait: float | None, *, communication: bool = False
) -> Verdict:
    """A straggler verdict with what made the rank slow: its own data wait, compute, or the time
    after its forward pass (communication).

    Args:
        verdict: a ``straggler`` verdict (evidence ``seconds`` and ``others_mean``).
        data_wait: the slow rank's wait for its batch in the step (None when unknown).
        communication: the rank's compute time was normal, its whole step time was not (then
            ``seconds`` and ``others_mean`` are step times).

    Returns:
        The verdict, its evidence extended by ``data_wait_seconds`` and ``cause``: "data_wait"
        when the wait accounts for at least half of the rank's excess over the others,
        "communication" when its compute was normal, else "compute".
    """
    if data_wait is None and not communication:
        return verdict
    excess = verdict.evidence["seconds"] - verdict.evidence["others_mean"]
    if data_wait is not None and data_wait >= 0.5 * excess:
        cause = "data_wait"
    else:
        cause = "communication" if communication else "compute"
    evidence = {**verdict.evidence, "data_wait_seconds": data_wait, "cause": cause}
    return dataclasses.replace(verdict, evidence=evidence)
