"""Which rank's loss was non-finite, told from the step's one SUM at any world size: the loss
signal packs ``[f, r·f, r²·f]`` on each simulated rank, the vectors are summed as the all-reduce
sums them, and the report names one or two ranks exactly and counts more; the verdict carries
them, and a non-finite gradient names its blocks, not a rank."""

from __future__ import annotations

import math

import pytest
import torch

from torchvitals.agent.detect.observed import Observed
from torchvitals.agent.detect.rules import NonFinite
from torchvitals.agent.detect.verdict import NONFINITE_GRAD, NONFINITE_LOSS
from torchvitals.agent.measure import ranksum
from torchvitals.agent.measure.reduce import Packer, Reduced
from torchvitals.agent.report import Report
from torchvitals.agent.signals.base import StepContext
from torchvitals.agent.signals.loss import Loss

CPU = torch.device("cpu")
NAN = float("nan")


def _ctx(rank: int, world: int, loss) -> StepContext:
    return StepContext(
        step=7,
        sampled=False,
        step_seconds=0.1,
        compute_seconds=0.05,
        loss=loss,
        scale=None,
        device=CPU,
        world_size=world,
        rank=rank,
    )


def _reduce(losses: dict[int, object], world: int) -> tuple[Report, int]:
    """Every simulated rank packs its loss (1.0 unless given); the SUM vectors are summed as the
    all-reduce sums them. Returns rank 0's report and the SUM payload's length."""
    summed, sum_len, handle = None, None, None
    for rank in sorted(set(losses) | {0}):
        signal, packer = Loss(), Packer(CPU)
        slots = signal.pack(_ctx(rank, world, losses.get(rank, torch.tensor(1.0))), packer)
        length, _, vector, _, local = packer.build()
        summed = vector.clone() if summed is None else summed + vector
        if rank == 0:
            sum_len, handle, local0 = length, slots, local
    # The ranks not simulated each add a finite loss of 1.0 (and no flag).
    absent = world - len(set(losses) | {0})
    summed[handle.device.start] += absent * 1.0
    summed[handle.host.start + 1] += absent * 1.0  # known
    report = Report(step=7, world_size=world)
    Loss().unpack(
        _ctx(0, world, None),
        handle,
        Reduced(torch.cat([summed, local0]).tolist(), sum_len, 0),
        report,
        Observed(),
    )
    return report, sum_len


@pytest.mark.parametrize("kind", ["tensor", "float"])
def test_one_rank_is_named_exactly_at_16k_ranks(kind):
    bad = torch.tensor(NAN) if kind == "tensor" else NAN
    for rank in (0, 1, 9_999, 16_383):
        report, _ = _reduce({rank: bad}, world=16_384)
        assert report.nonfinite_loss
        assert (report.nonfinite_rank_count, report.nonfinite_ranks) == (1, [rank])


def test_two_ranks_are_both_named_a_tensor_and_a_float_loss_alike():
    report, _ = _reduce({3: torch.tensor(math.inf), 16_000: NAN}, world=16_384)
    assert (report.nonfinite_rank_count, report.nonfinite_ranks) == (2, [3, 16_000])
    report, _ = _reduce({0: torch.tensor(NAN), 1: torch.tensor(NAN)}, world=2)
    assert report.nonfinite_ranks == [0, 1]


def test_three_ranks_are_counted_not_guessed():
    report, _ = _reduce({2: NAN, 5: torch.tensor(NAN), 11: NAN}, world=64)
    assert report.nonfinite_loss
    assert (report.nonfinite_rank_count, report.nonfinite_ranks) == (3, [])
    (verdict,) = NonFinite().observe(report, Observed())
    assert verdict.pattern == NONFINITE_LOSS and verdict.evidence["rank_count"] == 3
    assert "cannot be told" in verdict.evidence["ranks_unknown"]


def test_a_finite_step_names_no_rank_and_the_loss_is_the_mean():
    report, _ = _reduce({1: torch.tensor(3.0), 2: 5.0}, world=4)
    assert not report.nonfinite_loss and report.nonfinite_ranks == []
    assert report.loss == pytest.approx((1.0 + 3.0 + 5.0 + 1.0) / 4)


def test_the_payload_is_the_same_length_at_every_world_size():
    lengths = {_reduce({0: torch.tensor(1.0)}, world=w)[1] for w in (1, 2, 1024, 16_384)}
    lengths |= {_reduce({0: 1.0}, world=w)[1] for w in (1, 2, 16_384)}
    assert len(lengths) == 1, lengths


def test_decode_is_exact_for_one_and_two_and_counts_more():
    for a in (0, 1, 7, 16_383):
        assert ranksum.decode(*ranksum.encode(a, 1.0)) == (1, [a])
        for b in (a + 1, 16_383):
            if b > a:
                summed = [x + y for x, y in zip(ranksum.encode(a, 1.0), ranksum.encode(b, 1.0))]
                assert ranksum.decode(*summed) == (2, [a, b])
    assert ranksum.decode(0.0, 0.0, 0.0) == (0, [])
    assert ranksum.decode(3.0, 6.0, 14.0) == (3, [])


def test_the_grad_verdict_names_the_blocks_and_says_why_no_rank():
    report = Report(step=4, world_size=2, nonfinite_grad=True, nonfinite_loss=True)
    report.grad_norm = {"blocks.0": 1.0, "blocks.1": NAN, "lm_head": math.inf}
    report.nonfinite_ranks, report.nonfinite_rank_count = [1], 1
    verdicts = {v.pattern: v for v in NonFinite().observe(report, Observed())}
    assert verdicts[NONFINITE_LOSS].evidence["ranks"] == [1]
    grad = verdicts[NONFINITE_GRAD]
    assert grad.block == "blocks.1" and grad.evidence["blocks"] == ["blocks.1", "lm_head"]
    assert grad.evidence["ranks"] == [1] and "DDP" in grad.evidence["ranks_note"]
