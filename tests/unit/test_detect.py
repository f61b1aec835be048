"""The detector on synthetic report streams: each rule fires on its fingerprint, not on noise."""

import math
import random

import pytest

from torchvitals.agent.detect import PATTERNS, Detector, Thresholds
from torchvitals.agent.detect.observed import Observed
from torchvitals.agent.detect.straggler import RankTiming, slow_ranks
from torchvitals.agent.measure.blocks import EMBEDDING, HEAD, LAYER, OTHER
from torchvitals.agent.report import Report

NAMES = ["emb", "layers.0", "layers.1", "layers.2", "head", "other"]
KINDS = [EMBEDDING, LAYER, LAYER, LAYER, HEAD, OTHER]


def report(step, loss=2.0, norms=None, **kw):
    norms = norms or {b: 1.0 for b in NAMES}
    total = math.sqrt(sum(v * v for v in norms.values()))
    return Report(
        step=step,
        loss=loss,
        grad_norm=norms,
        grad_norm_total=total,
        nonfinite_loss=not math.isfinite(loss),
        nonfinite_grad=not math.isfinite(total),
        nonfinite=not (math.isfinite(loss) and math.isfinite(total)),
        **kw,
    )


def run(stream, detector=None, extras=None):
    detector = detector or Detector(NAMES, KINDS)
    fired = []
    for _i, r in enumerate(stream):
        fired += detector.observe(r, (extras or {}).get(r.step))
    return detector, fired


def noisy(steps, seed=0, start=3.0):
    rng = random.Random(seed)
    for s in range(1, steps + 1):
        loss = start * (0.99**s) * (1 + 0.03 * rng.gauss(0, 1))
        norms = {b: (0.5 + 0.1 * i) * (1 + 0.1 * rng.gauss(0, 1)) for i, b in enumerate(NAMES)}
        yield report(s, loss, norms)


def test_every_pattern_has_a_known_severity():
    assert set(PATTERNS.values()) <= {"info", "warning", "critical"}


def test_noisy_healthy_stream_raises_nothing():
    for seed in range(5):
        _, fired = run(noisy(400, seed))
        assert fired == [], fired[:3]


def test_one_step_far_out_is_an_outlier_warning_and_the_page_waits_for_the_next():
    stream = list(noisy(60))
    stream[49] = report(50, stream[48].loss * 3, stream[49].grad_norm)
    _, fired = run(stream)  # the next batch healed it: one bad batch, no page
    assert [(v.pattern, v.step, v.severity) for v in fired] == [("loss_outlier", 50, "warning")]
    ev = fired[0].evidence
    assert ev["loss"] > ev["threshold"] > ev["median"] and ev["fired"] == "loss_spike_severe"
    stream[50] = report(51, stream[48].loss * 3, stream[50].grad_norm)
    _, fired = run(stream)
    assert [(v.pattern, v.step, v.severity) for v in fired] == [
        ("loss_outlier", 50, "warning"),
        ("loss_spike", 51, "critical"),
    ]
    assert fired[1].evidence["fired"] == "loss_spike_mads"


def test_flat_loss_does_not_alarm_on_tiny_noise():
    stream = [report(s, 1.0 + (1e-6 if s % 2 else -1e-6)) for s in range(1, 200)]
    stream.append(report(200, 1.02))  # 2% above a flat series: within the ratio floor
    _, fired = run(stream)
    assert [v.pattern for v in fired] == []


def test_nonfinite_loss_and_grad_are_critical_every_time():
    stream = list(noisy(20))
    stream[14] = report(15, math.nan)
    bad = dict(stream[16].grad_norm, **{"layers.1": math.inf})
    stream[16] = report(17, 1.0, bad)
    _, fired = run(stream)
    assert [(v.pattern, v.step, v.block) for v in fired] == [
        ("nonfinite_loss", 15, None),
        ("nonfinite_grad", 17, "layers.1"),
    ]


def test_geometric_grad_growth_is_an_explosion_in_the_leading_block():
    stream = list(noisy(40))
    for k, s in enumerate(range(41, 45)):
        norms = {b: 0.6 for b in NAMES}
        norms["layers.0"] = 0.6 * 3 ** (k + 1)
        stream.append(report(s, 1.0, norms))
    _, fired = run(stream)
    patterns = {(v.pattern, v.block) for v in fired}
    assert ("grad_explosion", "layers.0") in patterns
    assert ("layer_divergence", "layers.0") in patterns


def test_vanishing_gradients_after_consecutive_steps():
    stream = []
    for s in range(1, 8):
        norms = {
            "emb": 1e-4,
            "layers.0": 1e-4,
            "layers.1": 1e-3,
            "layers.2": 0.05,
            "head": 0.1,
            "other": 0.1,
        }
        stream.append(report(s, 2.0, norms))
    _, fired = run(stream)
    assert [(v.pattern, v.step, v.block) for v in fired] == [("vanishing_gradients", 3, "layers.0")]
    assert fired[0].evidence["ratio"] == pytest.approx(500)


def test_dead_pipeline_on_detached_graph():
    stream = [report(s, 2.5, {b: 0.0 for b in NAMES}) for s in range(1, 10)]
    _, fired = run(stream)
    assert [(v.pattern, v.step) for v in fired] == [("dead_pipeline", 3)]
    assert fired[0].evidence["detached"] is True


def test_hot_lr_and_dead_layer_from_update_ratios():
    detector = Detector(NAMES, KINDS)
    fired = []
    for s in range(10, 120, 10):
        ratios = {b: 1e-3 for b in NAMES}
        ratios["layers.2"] = 0.0
        if s >= 100:
            ratios["layers.0"] = 5e-2
        fired += detector.observe(report(s, update_ratio=ratios))
    got = {(v.pattern, v.block, v.step) for v in fired}
    assert ("dead_layer", "layers.2", 20) in got
    assert ("hot_lr", "layers.0", 100) in got
    assert len([v for v in fired if v.pattern == "dead_layer"]) == 1, (
        "a warning is emitted once while active"
    )


def straggler_extras(times: list[float], steps: int) -> dict[int, Observed]:
    """What the reduction hands the detector at each step when every rank's compute time is
    ``times[rank]``: each rank judges itself and the SUM of their flags rides the next step."""
    t = Thresholds()
    ranks = [RankTiming(t, r, len(times)) for r in range(len(times))]
    extras = {}
    for s in range(1, steps + 1):
        extras[s] = Observed(straggler_flags=[sum(v) for v in zip(*(r.flags() for r in ranks))])
        for r, own in zip(ranks, times):
            r.observe(own, sum(times))
    return extras


def test_straggler_names_the_rank():
    extras = straggler_extras([0.10, 0.31, 0.11, 0.10], 8)
    _, fired = run([report(s) for s in range(1, 9)], extras=extras)
    # Slow from step 1, judged slow for the 5th time at step 5: its flag rides step 6's SUM.
    assert [(v.pattern, v.step, v.evidence["rank"]) for v in fired] == [("straggler", 6, 1)]
    evidence = fired[0].evidence
    assert evidence["seconds"] == 0.31 and evidence["slow_ranks"] == 1
    assert evidence["others_mean"] == pytest.approx((0.10 + 0.11 + 0.10) / 3)


def test_three_slow_ranks_are_counted_and_a_single_one_is_named_at_16k_ranks():
    flags = [3.0, 1 + 7 + 9, 1 + 49 + 81, 0.6, 0.03, 15.0]
    assert slow_ranks(flags) == (3, [None])
    r = 16_383
    assert slow_ranks([1.0, r, r * r, 0.2, 0.01, 5.0]) == (1, [r])
    assert slow_ranks([2.0, 5 + r, 25 + r * r, 0.4, 0.02, 10.0]) == (2, [5, r])


def test_generalization_gap():
    detector = Detector(NAMES, KINDS)
    fired = []
    for s in range(1, 101):
        if s % 20 == 0:
            detector.observe_validation(s, [2.0, 1.9, 2.0, 2.1, 2.3][s // 20 - 1])
        fired += detector.observe(report(s, 3.0 * 0.99**s))
    assert [(v.pattern, v.step) for v in fired] == [("generalization_gap", 100)]


def test_thresholds_are_configurable_and_unknown_ones_refused():
    assert Thresholds.from_overrides({"loss_spike_mads": 9}).loss_spike_mads == 9
    with pytest.raises(TypeError, match="loss_spike_madz"):
        Thresholds.from_overrides({"loss_spike_madz": 9})
    with pytest.raises(
        ValueError, match=r"loss_spike_recent_hits=4: at most .*loss_spike_recent \(3\)"
    ):
        Thresholds.from_overrides({"loss_spike_recent_hits": 4})
    with pytest.raises(ValueError, match="explosion_hold"):
        Thresholds.from_overrides({"explosion_hold": 1.5})


def test_two_slow_ranks_are_both_named():
    extras = straggler_extras([0.01, 0.2, 0.01, 0.2], 8)
    detector, fired = run([report(s) for s in range(1, 9)], extras=extras)
    assert sorted(v.evidence["rank"] for v in fired) == [1, 3]
    assert detector.active_counts()["straggler"] == 2


def test_memorised_loss_wiggling_near_zero_is_not_a_spike():
    rng = random.Random(0)
    stream = [report(s, 2.3 * 0.5**s + 1e-7 * (1 + rng.random())) for s in range(1, 40)]
    stream += [report(s, 1e-4 * (1 + rng.random())) for s in range(40, 80)]
    _, fired = run(stream)
    assert [v.pattern for v in fired] == []


def test_one_noisy_step_past_the_threshold_is_an_outlier_but_two_are_a_spike():
    stream = [report(s, 2.0 + 0.01 * (-1) ** s) for s in range(1, 40)]
    stream.append(report(40, 2.0 * 1.4))  # z ~ 8: a warning; the page needs a second step
    stream += [report(s, 2.0 + 0.01 * (-1) ** s) for s in range(41, 50)]
    _, fired = run(stream)
    assert [(v.pattern, v.step, v.severity) for v in fired] == [("loss_outlier", 40, "warning")]
    stream.append(report(50, 2.0 * 1.4))
    stream.append(report(51, 2.0 * 1.45))
    _, fired = run(stream)
    assert [(v.pattern, v.step) for v in fired] == [
        ("loss_outlier", 40),
        ("loss_outlier", 50),
        ("loss_spike", 51),
    ]


def test_a_spike_names_the_rank_whose_own_loss_alone_lifted_the_mean():
    stream = list(noisy(60))
    stream[49] = report(50, stream[48].loss * 3, stream[49].grad_norm, spike_ranks=[1])
    stream[49].spike_rank_count = 1
    _, fired = run(stream)
    ((outlier),) = fired
    assert outlier.pattern == "loss_outlier"
    assert (outlier.evidence["ranks"], outlier.evidence["rank_count"]) == ([1], 1)


def test_the_loss_level_is_the_last_judged_steps_median_and_threshold():
    detector = Detector(NAMES, KINDS)
    assert detector.loss_level() is None  # no history yet: no rank can be flagged
    run(list(noisy(40)), detector)
    median, threshold = detector.loss_level()
    assert 0 < median < threshold


def test_a_gradient_spike_names_the_rank_whose_own_activations_were_far_out():
    """The loss did not move, so no rank's loss names a culprit; on a sampled step the rank
    whose activations were far out while the others' were not is named instead."""
    stream = list(noisy(60))
    spiked = {b: 5.0 * v for b, v in stream[49].grad_norm.items()}
    stream[49] = report(
        50,
        stream[48].loss,
        spiked,
        world_size=2,
        activation_ranks=[1],
        activation_rank_count=1,
    )
    _, fired = run(stream)
    ((spike),) = fired
    assert spike.pattern == "grad_spike"
    assert (spike.evidence["ranks"], spike.evidence["culprit_from"]) == ([1], "activations")
