"""The vitals that are not numerics, reproduced for real: a leak, a sleeping loader, a replica
whose weights were changed in place on one DDP rank; and the same runs without the fault, silent.

    python -m pytest tests/scenarios/test_scenarios_vitals.py -q --durations=0
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from scenarios_vitals_ranks import corrupted_replica, loader_stall_on_one_rank
from support.models import TINY, TinyGPT, random_batches
from support.world import run_world

import torchvitals

PARAM = "blocks.1.mlp.0.weight"


def lm_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def gpt_run(
    steps: int,
    *,
    leak_bytes: int = 0,
    loader_sleep_s: float = 0.0,
    stall_from: int = 1,
    record: bool = False,
    **config,
):
    """Train the tiny GPT ``steps`` steps; return (reports, history as (pattern, step, evidence)).

    ``leak_bytes`` per step go into a list that is never freed (touched, so they are resident);
    the loader sleeps ``loader_sleep_s`` per batch from batch ``stall_from`` on; ``record`` draws
    the batches itself and tells the agent with ``record_data_wait`` instead of ``batches``.
    """
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = list(random_batches(steps, batch=8, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))

    def loader():
        for i, batch in enumerate(data, start=1):
            if i >= stall_from and loader_sleep_s:
                time.sleep(loader_sleep_s)
            yield batch

    leak, reports = [], []
    with torchvitals.watch(model, opt, metrics_port=0, log_dir="", **config) as agent:
        if record:
            it = loader()
            batches = []
            for _ in range(steps):
                start = time.perf_counter()
                batches.append(next(it))
                agent.record_data_wait(time.perf_counter() - start)
                x, y = batches[-1]
                loss = lm_loss(model, x, y)
                loss.backward()
                reports.append(agent.step(loss))
                opt.zero_grad(set_to_none=True)
        else:
            for x, y in agent.batches(loader()):
                if leak_bytes:
                    leak.append(torch.ones(leak_bytes // 4))
                loss = lm_loss(model, x, y)
                loss.backward()
                reports.append(agent.step(loss, samples=x.shape[0], tokens=x.numel()))
                opt.zero_grad(set_to_none=True)
        history = [(v.pattern, v.step, v.evidence) for v in agent.detector.history]
    return reports, history


# ---------------------------------------------------------------- memory growth


def test_leaking_list_of_tensors_is_memory_growth():
    reports, history = gpt_run(110, leak_bytes=4 << 20)
    found = [(p, s) for p, s, _ in history]
    # Samples every 10 steps; the first past warm-up is step 20, and memory_growth_samples=8
    # rises after it end at step 100.
    assert found == [("memory_growth", 100)], found
    evidence = history[0][2]
    assert evidence["memory"] == "resident_bytes"
    # 4 MiB a step over 80 steps; the allocator's own noise is a few MiB.
    assert 300 * 2**20 <= evidence["rise_bytes"] <= 360 * 2**20, evidence
    assert evidence["bytes_per_step"] > 3.5 * 2**20
    sampled = [r.memory["resident_bytes"] for r in reports if r.memory]
    assert len(sampled) == 12 and sampled[-1] > sampled[1] + 300 * 2**20


def test_same_run_without_the_leak_is_silent():
    reports, history = gpt_run(110)
    assert history == []
    sampled = [r.memory["resident_bytes"] for r in reports if r.memory]
    assert len(sampled) == 12 and max(sampled[2:]) - min(sampled[2:]) < 64 * 2**20


# ---------------------------------------------------------------- data stall


STALL_S = 0.15
"""The slow loader's sleep per batch: several times a tiny GPT step even on a busy 2-core machine
running two test workers, so the stall's ratio stays far above the rule's 50%."""


def test_sleeping_loader_is_a_data_stall():
    reports, history = gpt_run(30, loader_sleep_s=STALL_S, stall_from=15)
    found = [(p, s) for p, s, _ in history]
    assert found == [("data_stall", 19)], found  # data_stall_steps=5 stalled steps: 15..19
    assert history[0][2]["data_wait_ratio"] >= 0.5
    assert all(r.timing.data_wait_seconds >= STALL_S for r in reports[14:])
    assert all(r.timing.data_wait_seconds < STALL_S / 5 for r in reports[1:14])
    # The tokens and samples the caller passed.
    assert reports[-1].local.tokens == 8 * TINY["seq_len"] and reports[-1].local.samples == 8


def test_data_wait_recorded_by_the_caller_is_a_data_stall_too():
    _, history = gpt_run(30, loader_sleep_s=STALL_S, stall_from=15, record=True)
    assert [(p, s) for p, s, _ in history] == [("data_stall", 19)]


def test_a_data_stall_does_not_stop_healthy_checkpoints(tmp_path):
    """A slow loader leaves the weights as good as they were: the watchdog keeps saving, so a
    later failure does not roll back to before the stall began."""
    reports, history = gpt_run(
        30,
        loader_sleep_s=STALL_S,
        stall_from=12,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=5,
        healthy_window=2,
    )
    # The stall is seen (its exact step is test_sleeping_loader_is_a_data_stall's business).
    assert [p for p, _, _ in history] == ["data_stall"]
    assert [r.step for r in reports if r.checkpoint.saved] == [5, 10, 15, 20, 25, 30]


def test_fast_loader_is_silent():
    reports, history = gpt_run(30)
    assert history == []
    assert max(r.timing.data_wait_ratio for r in reports[10:]) < 0.2


# ---------------------------------------------------------------- replica divergence (DDP)


@pytest.mark.distributed
def test_weight_changed_on_one_replica_is_caught_and_rolled_back(tmp_path):
    """Rank 1's weight changes in place at step 23, after the all-reduce; the next sample
    (step 25) names the block on both ranks in the same step, and both roll back to step 20."""
    results = run_world(corrupted_replica, 40, 1, 23, PARAM, str(tmp_path / "ckpt"), 5)
    for rank, result in enumerate(results):
        assert result["history"] == [("replica_divergence", 25)], (rank, result["history"])
        steps = result["steps"]
        at = next(s for s in steps if s["verdicts"])
        assert at["verdicts"] == [
            ("replica_divergence", "critical", "blocks.1", 25, {"blocks.1": [0, 1]}, [0, 1])
        ]  # two ranks: no majority
        assert at["action"] == "rollback" and at["to_step"] == 20
    zero, one = results
    for a, b in zip(zero["steps"], one["steps"]):
        assert a["verdicts"] == b["verdicts"] and a["action"] == b["action"]
    corrupted = [
        i
        for i, (a, b) in enumerate(zip(zero["steps"], one["steps"]))
        if a["checksum"] != b["checksum"]
    ]
    assert corrupted == [22, 23], corrupted  # steps 23 and 24 only: rolled back at 25
    assert zero["checksum"] == one["checksum"], "the replicas are identical again"
    assert sum(s["checked"] for s in zero["steps"]) >= 8


@pytest.mark.slow
@pytest.mark.distributed
def test_three_replicas_name_the_odd_one_out():
    results = run_world(corrupted_replica, 12, 1, 7, PARAM, None, 5, world=3)
    for rank, result in enumerate(results):
        verdicts = [v for s in result["steps"] for v in s["verdicts"]]
        # Without a watchdog the critical verdict holds at every sample after the change.
        assert [v[3] for v in verdicts] == [10], (rank, verdicts)
        assert verdicts[0][4:] == ({"blocks.1": [1]}, [1])


@pytest.mark.distributed
def test_identical_replicas_stay_silent():
    results = run_world(corrupted_replica, 30, 1, -1, PARAM, None, 5)
    for result in results:
        assert result["history"] == []
        assert [s["step"] for s in result["steps"] if s["checked"]] == [1, 5, 10, 15, 20, 25, 30]
    assert results[0]["checksum"] == results[1]["checksum"]


# ---------------------------------------------------------------- straggler: data or compute


@pytest.mark.slow
@pytest.mark.distributed
def test_straggler_says_whether_data_or_compute_made_it_slow():
    data = run_world(loader_stall_on_one_rank, 20, 1, 11, 0.15, "data")
    compute = run_world(loader_stall_on_one_rank, 20, 1, 11, 0.15, "compute")
    for result in data:
        # Rank 1 judges itself slow at step 15; its flag rides step 16's reduction.
        assert result["stragglers"] == [(16, 1, "data_wait")], result["stragglers"]
        # One rank waiting is a straggler, not a job-wide data stall.
        assert result["others"] == []
    for result in compute:
        assert result["stragglers"] == [(16, 1, "compute")], result["stragglers"]
        assert result["others"] == []
