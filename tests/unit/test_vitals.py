"""The vitals' pieces alone: replica fingerprints, data wait, memory reads, and their rules.

python -m pytest tests/unit/test_vitals.py -q
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from torch import nn

from torchvitals.agent.detect.observed import Observed
from torchvitals.agent.detect.rules_vitals import DataStall, MemoryGrowth, ReplicaDivergence
from torchvitals.agent.detect.straggler import straggler_cause
from torchvitals.agent.detect.thresholds import Thresholds
from torchvitals.agent.detect.verdict import STRAGGLER, WARNING, Verdict
from torchvitals.agent.measure.blocks import discover
from torchvitals.agent.measure.datawait import DataWait
from torchvitals.agent.measure.fingerprint import Fingerprint
from torchvitals.agent.measure.host import MemorySample, accelerator_memory, process_vitals
from torchvitals.agent.report import Report


def model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # The 1024 x 1024 weight is large enough for the sum to split across threads (and its int32
    # sum wraps many times over).
    return nn.Sequential(
        nn.Embedding(50, 64), nn.Linear(64, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 3)
    ).to(dtype)


def flip_lowest_bit(t: torch.Tensor, index: int = 0) -> None:
    """Flip the least significant mantissa bit of one float32 element (a one-ulp change)."""
    flat = t.detach().view(-1)
    bits = struct.unpack("<i", struct.pack("<f", float(flat[index])))[0] ^ 1
    with torch.no_grad():
        flat[index] = struct.unpack("<f", struct.pack("<i", bits))[0]


# ---------------------------------------------------------------- fingerprints


def test_fingerprint_is_an_exact_integer_per_block_whatever_the_threads():
    m = model()
    fp = Fingerprint(discover(m))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fp.compute(torch.device("cpu"))
        torch.set_num_threads(2)
        two = fp.compute(torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert one.dtype == torch.float64 and len(one) == len(fp.names)
    assert all(float(v).is_integer() and 0 <= v < 2**52 for v in one.tolist())
    # The same numbers from plain Python integers: each parameter's fp32 bits summed modulo
    # 2**32, those sums added per block.
    expected = []
    for ps in discover(m).params:
        sums = [sum(p.detach().view(torch.int32).view(-1).tolist()) % 2**32 for _, p in ps]
        expected.append(sum(sums) % 2**52)
    assert one.tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_ulp_in_one_element_changes_its_blocks_fingerprint_only(dtype):
    m = model(dtype)
    blocks = discover(m)
    fp = Fingerprint(blocks)
    before = fp.compute(torch.device("cpu"))
    target = m[1].weight
    with torch.no_grad():
        flat = target.view(-1)
        flat[7] = torch.nextafter(flat[7], torch.tensor(math.inf, dtype=dtype))
    after = fp.compute(torch.device("cpu"))
    changed = [blocks.names[b] for b in range(len(blocks)) if before[b] != after[b]]
    assert changed == [blocks.names[blocks.block_of("1")]]
    # The sign bit (a change of 2**31 in the integer) and an exponent bit count too.
    for bit in (31, 27):
        m2 = model()
        fp2 = Fingerprint(discover(m2))
        before = fp2.compute(torch.device("cpu"))
        flat = m2[2].weight.detach().view(-1).view(torch.int32)
        flat[5] ^= 1 << bit if bit < 31 else -(1 << 31)
        assert (fp2.compute(torch.device("cpu")) != before).sum() == 1, bit


def test_mismatch_is_read_from_max_of_x_and_of_minus_x():
    m = model()
    fp = Fingerprint(discover(m))
    a = fp.pack(torch.device("cpu"))
    flip_lowest_bit(m[3].weight)
    b = fp.pack(torch.device("cpu"))
    reduced = torch.maximum(a, b).tolist()  # what the MAX all-reduce of two ranks gives
    assert fp.mismatched(reduced) == [fp.names.index("3")]
    assert fp.mismatched(torch.maximum(a, a).tolist()) == []


# ---------------------------------------------------------------- data wait


def test_data_wait_times_each_draw_and_is_taken_once_per_step():
    now = [0.0]
    wait = DataWait(clock=lambda: now[0])

    def slow():
        for i in range(3):
            now[0] += 0.5 * (i + 1)  # the loader takes 0.5, 1.0, 1.5 s
            yield i

    seen = []
    for item in wait.timed(slow()):
        seen.append((item, wait.take()))
        now[0] += 10.0  # compute: not data wait
    assert seen == [(0, 0.5), (1, 1.0), (2, 1.5)]
    wait.record(0.25)
    with wait.waiting():
        now[0] += 2.0
    assert wait.take() == 2.25 and wait.take() == 0.0
    with pytest.raises(ValueError):
        wait.record(-1.0)
    with pytest.raises(ValueError):
        wait.record(math.nan)


# ---------------------------------------------------------------- memory reads


def test_process_vitals_and_cpu_memory_sample():
    v = process_vitals()
    assert v["resident_bytes"] > 10 * 2**20 and v["cpu_seconds"] > 0 and v["open_fds"] >= 3
    assert v["children"] >= 0 and v["host_available_bytes"] > 0
    sample = MemorySample(torch.device("cpu"))
    rss, device = sample.read()
    assert rss > 10 * 2**20 and device == 0.0 and sample.accelerator is None
    assert accelerator_memory(torch.device("cpu")) is None
    assert MemorySample.unpack([rss, 0.0], accelerator=False) == {"resident_bytes": rss}


# ---------------------------------------------------------------- rules


def report(step: int, **kw) -> Report:
    return Report.from_flat(step=step, loss=1.0, grad_norm={}, grad_norm_total=1.0, **kw)


def test_memory_growth_needs_a_steady_rise_past_warmup():
    t = Thresholds()
    mib = 2**20
    rule = MemoryGrowth(t)
    fired = []
    for i, step in enumerate(range(10, 120, 10)):
        found = rule.observe(
            report(step, memory={"resident_bytes": 1000 * mib + 10 * mib * i}), Observed()
        )
        fired += [(v.step, v.evidence["memory"]) for v in found]
    # Step 10 is warm-up; 20..100 are the 9 samples of 8 rises of 10 MiB: 80 >= 64 MiB.
    assert fired[0] == (100, "resident_bytes")
    assert rule.observe(report(121), Observed()) is None  # unsampled: nothing to judge
    dip = MemoryGrowth(t)
    values = [1000, 1010, 1020, 1030, 1029] + [1040 + 10 * k for k in range(8)]
    found = [
        v
        for i, x in enumerate(values)
        for v in dip.observe(report(20 + 10 * i, memory={"resident_bytes": x * mib}), Observed())
    ]
    assert [v.step for v in found] == [20 + 10 * 12]  # 8 rises after the dip, not before
    small = MemoryGrowth(t)
    assert not [
        v
        for i in range(12)
        for v in small.observe(
            report(20 + 10 * i, memory={"resident_bytes": 1e9 + i * 1e6}), Observed()
        )
    ]


def test_data_stall_wants_the_share_and_the_seconds_for_several_steps():
    rule = DataStall(Thresholds())
    steps = [
        rule.observe(report(s, data_wait_ratio=0.8, data_wait_mean_seconds=0.05), Observed())
        for s in range(11, 16)
    ]
    assert [bool(f) for f in steps] == [False] * 4 + [True]
    assert steps[-1][0].evidence["data_wait_ratio"] == 0.8
    tiny = DataStall(Thresholds())
    assert not any(
        tiny.observe(report(s, data_wait_ratio=0.9, data_wait_mean_seconds=0.001), Observed())
        for s in range(11, 30)
    )
    early = DataStall(Thresholds())
    assert not any(
        early.observe(report(s, data_wait_ratio=0.9, data_wait_mean_seconds=1.0), Observed())
        for s in range(1, 11)
    )


def test_replica_divergence_is_critical_and_names_blocks_and_ranks():
    rule = ReplicaDivergence(Thresholds())
    assert rule.observe(report(3), Observed()) is None
    assert rule.observe(report(5, replicas_checked=True), Observed()) == []
    (v,) = rule.observe(
        report(10, replicas_checked=True, replica_mismatch={"blocks.1": [2], "head": [2, 3]}),
        Observed(),
    )
    assert (v.pattern, v.severity, v.block) == ("replica_divergence", "critical", "blocks.1")
    assert v.evidence["ranks"] == [2, 3] and v.evidence["blocks"]["head"] == [2, 3]


def test_straggler_cause_compares_the_wait_with_the_excess():
    v = Verdict(STRAGGLER, WARNING, 15, None, {"rank": 1, "seconds": 0.3, "others_mean": 0.1})
    assert straggler_cause(v, None) is v
    assert straggler_cause(v, 0.15).evidence["cause"] == "data_wait"
    assert straggler_cause(v, 0.05).evidence["cause"] == "compute"
    assert straggler_cause(v, 0.05).evidence["data_wait_seconds"] == 0.05
