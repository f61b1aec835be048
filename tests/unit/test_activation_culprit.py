"""Which rank's own activations were far out on a sampled step, told from the step's one SUM:
each simulated rank runs its own forward, packs ``[f, r·f, r²·f]`` (its block RMS against the
block's RMS over the ranks at the last clean sample), the vectors are summed and maxed as the
collectives would, and every rank's report names the same rank. A growth every rank shares (a
learning rate too hot) names none, and the spike rules carry the name as their culprit when
the loss names no rank."""

from __future__ import annotations

import torch
from torch import nn

from torchvitals.agent.detect.observed import Observed
from torchvitals.agent.detect.rules import culprits
from torchvitals.agent.measure.activations import ActivationStats
from torchvitals.agent.measure.attention import AttentionStats
from torchvitals.agent.measure.blocks import discover
from torchvitals.agent.measure.reduce import Packer, Reduced
from torchvitals.agent.report import Report
from torchvitals.agent.signals.activations import ActivationSignal
from torchvitals.agent.signals.base import StepContext

CPU = torch.device("cpu")
WORLD = 3
FACTOR = 8.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)
    )


def _ctx(step: int, rank: int) -> StepContext:
    return StepContext(
        step=step,
        sampled=True,
        step_seconds=0.1,
        compute_seconds=0.05,
        loss=None,
        scale=None,
        device=CPU,
        world_size=WORLD,
        rank=rank,
    )


class Ranks:
    """``WORLD`` ranks, each with its own replica of the model and its own signal."""

    def __init__(self) -> None:
        self.models = [_model() for _ in range(WORLD)]
        self.signals = []
        for model in self.models:
            blocks = discover(model)
            self.signals.append(
                ActivationSignal(
                    ActivationStats(blocks.output_modules, 1.0),
                    AttentionStats(model, blocks),
                    blocks.names,
                    culprit_factor=FACTOR,
                )
            )

    def step(self, step: int, scale: dict[int, float]) -> list[Report]:
        """One sampled step: rank r's inputs times ``scale.get(r, 1)``; every rank's report."""
        packed = []
        for rank, (model, signal) in enumerate(zip(self.models, self.signals)):
            signal.arm()
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x * scale.get(rank, 1.0)).sum().backward()
            packer = Packer(CPU)
            slots = signal.pack(_ctx(step, rank), packer)
            sum_len, max_len, sums, maxes, _ = packer.build()
            packed.append((slots, sum_len, max_len, sums, maxes))
        summed = torch.stack([p[3] for p in packed]).sum(0)
        maxed = torch.stack([p[4] for p in packed]).amax(0)
        reports = []
        for rank, (signal, (slots, sum_len, max_len, _, _)) in enumerate(zip(self.signals, packed)):
            report = Report(step=step, world_size=WORLD)
            reduced = Reduced(torch.cat([summed, maxed]).tolist(), sum_len, max_len)
            signal.unpack(_ctx(step, rank), slots, reduced, report, Observed())
            reports.append(report)
        return reports


def named(reports: list[Report]) -> list[tuple[int, list[int]]]:
    return [(r.activation_rank_count, r.activation_ranks) for r in reports]


def test_the_rank_whose_own_activations_are_far_out_is_named_on_every_rank():
    ranks = Ranks()
    assert named(ranks.step(1, {})) == [(0, [])] * WORLD  # nothing to judge against yet
    assert named(ranks.step(2, {})) == [(0, [])] * WORLD
    assert named(ranks.step(3, {2: 100.0})) == [(1, [2])] * WORLD
    # The far-out sample is not the next one's reference: rank 1 is judged against step 2's.
    assert named(ranks.step(4, {1: 100.0})) == [(1, [1])] * WORLD
    assert named(ranks.step(5, {0: 100.0, 2: 100.0})) == [(2, [0, 2])] * WORLD
    assert named(ranks.step(6, {})) == [(0, [])] * WORLD


def test_a_growth_every_rank_shares_names_no_rank():
    ranks = Ranks()
    ranks.step(1, {})
    reports = ranks.step(2, {r: 100.0 for r in range(WORLD)})
    assert named(reports) == [(WORLD, [])] * WORLD
    assert culprits(reports[0]) == {}


def test_a_factor_below_the_growth_flags_and_above_it_does_not():
    for scale, flagged in ((FACTOR * 0.8, 0), (FACTOR * 1.5, 1)):
        ranks = Ranks()
        ranks.step(1, {})
        ranks.step(2, {})
        # Linear layers with ReLUs: an input scaled by s scales every block's RMS by s.
        assert ranks.step(3, {1: scale})[0].activation_rank_count == flagged, scale


def test_the_loss_names_the_culprit_first_and_the_activations_when_it_does_not():
    by_loss = Report(step=5, world_size=4, spike_ranks=[3], spike_rank_count=1)
    by_loss.activation_ranks, by_loss.activation_rank_count = [1], 1
    assert culprits(by_loss) == {"ranks": [3], "rank_count": 1, "culprit_from": "loss"}
    by_acts = Report(step=5, world_size=4, activation_ranks=[1], activation_rank_count=1)
    assert culprits(by_acts) == {"ranks": [1], "rank_count": 1, "culprit_from": "activations"}
    every = Report(step=5, world_size=2, activation_ranks=[0, 1], activation_rank_count=2)
    assert culprits(every) == {}
