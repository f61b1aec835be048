"""Global rank 0's incidents and goodput step records: a NaN is an incident written within the
step that saw it, naming the rank, node, host and pid, updated with its rollback's cost; a run of
skipped steps, a straggler's episode are one incident each; the cause of a straggler is told;
a folder that cannot be written never reaches the training. (Two gloo ranks under DDP:
tests/distributed/test_incidents_ddp.py.)"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import time

import pytest
import torch
from prometheus_client import CollectorRegistry
from support.models import TINY, TinyGPT, random_batches

import torchvitals
from torchvitals.agent.detect.observed import Observed
from torchvitals.agent.detect.straggler import RankTiming, Straggler
from torchvitals.agent.detect.thresholds import Thresholds
from torchvitals.agent.detect.verdict import (
    CRITICAL,
    LOSS_SPIKE,
    NONFINITE_LOSS,
    ROLLBACK_LOOP,
    STRAGGLER,
    WARNING,
    Verdict,
)
from torchvitals.agent.outputs.incidents import (
    IncidentWriter,
    gather_places,
    node_rank,
    supervisor_attempt,
)
from torchvitals.agent.outputs.sinks import Sink
from torchvitals.agent.report import Action, Report, Rollback
from torchvitals.protocol import ATTEMPT_ENV, NODE_ENV
from torchvitals.records.goodput import account
from torchvitals.records.incidents import Culprit, IncidentLog

QUIET = {"log_dir": "", "metrics_port": 0}


class IncidentsAtPublish(Sink):
    """Reads the job's incident files when each step publishes: what existed within the step."""

    def __init__(self, folder) -> None:
        self.log, self.seen = IncidentLog(folder), {}

    def publish(self, report: Report) -> None:
        # The first time a step number publishes (a rollback runs it again).
        self.seen.setdefault((report.step, str(report.action)), [i.key for i in self.log.read()[0]])


def _train(agent, model, opt, steps, nan_at=(), once=True, before_step=lambda: None):
    done = set()
    for x, y in random_batches(steps, batch=2, seq_len=TINY["seq_len"], vocab=TINY["vocab"]):
        before_step()
        step = agent.step_count + 1
        loss = model.loss(x, y)
        if step in nan_at and not (once and step in done):
            done.add(step)
            loss = loss * float("nan")
        loss.backward()
        agent.step(loss)
        opt.zero_grad(set_to_none=True)


def _model():
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _lines(folder) -> list[dict]:
    (path,) = (folder / "goodput").glob("steps-a0000-p*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_nan_is_an_incident_written_in_its_step_and_costed_by_its_rollback(tmp_path):
    model, opt = _model()
    registry, sink = CollectorRegistry(), IncidentsAtPublish(tmp_path)
    agent = torchvitals.watch(
        model,
        opt,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=5,
        healthy_window=2,
        trust_steps=1,  # step 10's checkpoint is the target of the NaN at 12
        snapshot_max_bytes=0,
        registry=registry,
        sinks=[sink],
        **QUIET,
    )
    try:
        _train(agent, model, opt, 14, nan_at={12})
        counted = registry.get_sample_value(
            "torchvitals_incidents_total",
            {"kind": "nonfinite", "rank": "0", "node": "0", "host": socket.gethostname()},
        )
    finally:
        agent.close()
    key = "nonfinite-a0000-s00000012"
    # Written within the step that saw it: there when that step published, not before.
    assert sink.seen[12, "rollback"] == [key] and sink.seen[11, "step"] == []
    (incident,), problems = IncidentLog(tmp_path).read()
    assert not problems and incident.key == key and incident.step == 12
    assert incident.culprit == Culprit(rank=0, node=0, host=socket.gethostname(), pid=os.getpid())
    assert incident.evidence["ranks"] == [0] and "rank 0's loss" in incident.cause
    assert counted == 1
    # Its cost: from the end of the restored step 10 to the end of the restore.
    lines = _lines(tmp_path)
    end10 = next(x["t"] for x in lines if x["e"] == "step" and x["s"] == 10)
    rolled = [x for x in lines if x["e"] == "step" and x["x"] == "rollback"]
    assert [x["s"] for x in rolled] == [12] and rolled[0]["c"] > 0
    assert incident.detected_at <= incident.recovered_at <= rolled[0]["t"]
    assert incident.lost_seconds == pytest.approx(incident.recovered_at - end10, abs=1e-3)


def test_the_step_records_say_each_steps_end_duration_wait_and_checkpoint(tmp_path):
    model, opt = _model()
    agent = torchvitals.watch(
        model, opt, checkpoint_dir=str(tmp_path), checkpoint_every=3, healthy_window=1, **QUIET
    )
    try:
        data = list(random_batches(6, batch=2, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))
        for x, y in agent.batches(data):
            loss = model.loss(x, y)
            loss.backward()
            agent.step(loss)
            opt.zero_grad(set_to_none=True)
    finally:
        agent.close()
    start, *steps = _lines(tmp_path)
    assert start["e"] == "start" and start["resumed"] == 0 and start["a"] == 0
    assert [s["s"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[0]["d"] == pytest.approx(steps[0]["t"] - start["t"], abs=1e-6)
    for before, after in itertools.pairwise(steps):
        assert after["d"] == pytest.approx(after["t"] - before["t"], abs=1e-6)
    assert [s["c"] > 0 for s in steps] == [False, False, True, False, False, True]
    assert all(0 <= s["w"] <= s["d"] for s in steps) and {s["x"] for s in steps} == {"step"}


def test_a_run_of_skipped_nonfinite_steps_is_one_incident(tmp_path):
    model, opt = _model()
    agent = torchvitals.watch(model, opt, log_dir=str(tmp_path), run_name="r", metrics_port=0)
    # The records' and the incidents' clock, moved by the loop: step n ends at 1000 + n seconds.
    clock = itertools.count(1001.0)
    now = [1000.0]
    agent._incidents._clock = agent._timeline._clock = lambda: now[0]
    try:
        _train(
            agent, model, opt, 6, nan_at={3, 4}, before_step=lambda: now.__setitem__(0, next(clock))
        )
    finally:
        agent.close()
    (incident,), _ = IncidentLog(tmp_path / "r").read()
    assert incident.key == "nonfinite-a0000-s00000003" and incident.culprit.rank == 0
    steps = [x for x in _lines(tmp_path / "r") if x["e"] == "step"]
    assert [x["x"] for x in steps] == ["step", "step", "skip", "skip", "step", "step"]
    assert [x["t"] for x in steps] == [1001.0, 1002.0, 1003.0, 1004.0, 1005.0, 1006.0]
    # The two skipped steps' wall time; it ended when step 5 trained again.
    assert incident.lost_seconds == steps[2]["d"] + steps[3]["d"] == 2.0
    assert incident.recovered_at == steps[4]["t"]


def _straggler(step: int, rank: int, seconds: float, others: float, cause: str) -> Verdict:
    evidence = {"rank": rank, "seconds": seconds, "others_mean": others, "steps": 5}
    evidence |= {"cause": cause, "data_wait_seconds": 0.0}
    return Verdict(STRAGGLER, WARNING, step, None, evidence)


def test_a_straggler_is_one_incident_per_episode_with_its_cost_and_cause(tmp_path):
    places = {3: Culprit(rank=3, node=1, host="b", pid=42)}
    clock = iter(float(t) for t in range(1000, 2000))
    writer = IncidentWriter(IncidentLog(tmp_path), places, clock=lambda: next(clock))
    for step in range(1, 20):
        slow = 6 <= step <= 9 or step >= 15
        active = [_straggler(step, 3, 0.5, 0.2, "compute")] if slow else []
        report = Report(step=step, world_size=4, verdicts=active[: step in (6, 15)])
        writer.seen(report, active)
        writer.acted(report)
    writer.close()
    first, second = IncidentLog(tmp_path).read()[0]
    assert (first.key, second.key) == (
        "straggler-a0000-r3-s00000001",
        "straggler-a0000-r3-s00000010",
    )
    assert first.culprit == places[3] and "compute" in first.cause
    assert first.lost_seconds == pytest.approx(4 * 0.3) and first.recovered_at is not None
    assert second.lost_seconds == pytest.approx(5 * 0.3) and second.recovered_at is None


def test_a_spike_that_comes_back_after_its_rollback_is_a_record_of_its_own_naming_the_first(
    tmp_path,
):
    """A spike at 62 rolls back to 50; the replay meets it at 62 again and the repeat goes to
    40: two incidents (the replay numbers its steps again), each saying its remedy, the second
    naming the first. A skipped outlier's step says ``skip_update``; an abort says ``abort``."""
    clock = iter(float(t) for t in range(1000, 2000))
    writer = IncidentWriter(IncidentLog(tmp_path), None, clock=lambda: next(clock))
    spike = Verdict(LOSS_SPIKE, CRITICAL, 62, None, {"loss": 7.0, "ranks": []})
    nan = Verdict(NONFINITE_LOSS, CRITICAL, 55, None, {"ranks": [1]})
    plan = [
        (Report(step=55, verdicts=[nan], nonfinite_ranks=[1]), Action.SKIP, None),
        (Report(step=62, verdicts=[spike]), Action.ROLLBACK, Rollback(to_step=50, lr_scale=0.5)),
        (
            Report(step=62, verdicts=[spike]),
            Action.ROLLBACK,
            Rollback(to_step=40, lr_scale=0.125, repeat_of=62, escalation=1),
        ),
    ]
    for report, action, rollback in plan:
        writer.seen(report, [])
        report.action, report.rollback = action, rollback
        writer.acted(report)
    writer.aborted(Report(step=62), Verdict(ROLLBACK_LOOP, CRITICAL, 62, None, {"why": "none"}))
    found = {i.key: i for i in IncidentLog(tmp_path).read()[0]}
    assert {k: (i.remedy, i.repeat_of) for k, i in found.items()} == {
        "nonfinite-a0000-s00000055": ("skip_update", None),
        "loss_spike-a0000-s00000062": ("rollback", None),
        "loss_spike-a0000-s00000062-x1": ("rollback", "loss_spike-a0000-s00000062"),
        "abort-a0000-s00000062-x2": ("abort", None),
    }
    assert (
        found["loss_spike-a0000-s00000062-x1"]
        .line()
        .endswith("(a repeat of loss_spike-a0000-s00000062)")
    )


def test_a_rank_slow_after_its_forward_is_a_communication_straggler():
    t = Thresholds()
    ranks = [RankTiming(t, r, 4) for r in range(4)]
    compute, steps = [0.1, 0.1, 0.1, 0.1], [0.3, 0.3, 0.3, 0.9]
    for _ in range(t.straggler_steps):
        for r, timing in enumerate(ranks):
            others = (sum(steps) - steps[r]) / 3
            timing.observe(compute[r], sum(compute), 0.0, step=(steps[r], others))
    flags = [sum(v) for v in zip(*(r.flags() for r in ranks))]
    (verdict,) = Straggler(t).observe(Report(step=6, world_size=4), Observed(straggler_flags=flags))
    assert verdict.evidence["rank"] == 3 and verdict.evidence["cause"] == "communication"
    assert verdict.evidence["seconds"] == 0.9


def test_an_abort_is_an_incident_of_the_supervisors_attempt(tmp_path, monkeypatch):
    monkeypatch.setenv(ATTEMPT_ENV, "3")
    writer = IncidentWriter(
        IncidentLog(tmp_path), None, attempt=supervisor_attempt(), supervised=True
    )
    loop = Verdict(
        ROLLBACK_LOOP, "critical", 40, None, {"reason": "nonfinite_loss", "exit_code": 75}
    )
    writer.aborted(Report(step=40), loop)
    (incident,), _ = IncidentLog(tmp_path).read()
    assert (incident.kind, incident.key, incident.attempt) == ("abort", "abort-a0003-s00000040", 3)
    assert "exit code 75" in incident.cause and incident.culprit.rank is None


def test_a_folder_that_cannot_be_written_never_reaches_the_training(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    writer = IncidentWriter(IncidentLog(blocked), None)
    report = Report(step=2, nonfinite_loss=True, nonfinite_ranks=[1], nonfinite_rank_count=1)
    report.verdicts = [Verdict("nonfinite_loss", "critical", 2, None, {})]
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            writer.seen(report, [])
            writer.acted(report)
    assert caplog.text.count("cannot write an incident") == 1


def test_the_node_is_the_supervisors_then_the_launchers():
    assert node_rank(5, {NODE_ENV: "2", "GROUP_RANK": "1"}) == 2
    assert node_rank(5, {"GROUP_RANK": "1", "SLURM_NODEID": "4"}) == 1
    assert node_rank(5, {"SLURM_NODEID": "4"}) == 4
    assert node_rank(5, {"LOCAL_WORLD_SIZE": "2"}) == 2
    assert node_rank(5, {}) is None
    # One process: itself, node 0 of its one host.
    assert gather_places(None, 0, 1) == {
        0: Culprit(rank=0, node=node_rank(0) or 0, host=socket.gethostname(), pid=os.getpid())
    }


def test_a_frameworks_own_checkpoint_load_after_watch_is_checkpoint_time_not_work(tmp_path):
    # torchtitan loads its checkpoint inside its trainer, after watch() returned: the load
    # delays the first step, and without resume_at's seconds the accounting booked it as that
    # step's productive work.
    model, opt = _model()
    agent = torchvitals.watch(model, opt, checkpoint_dir=str(tmp_path), **QUIET)
    try:
        time.sleep(0.3)  # the framework's load
        agent.resume_at(40, load_seconds=0.3)
        agent.resume_at(40, load_seconds=float("nan"))  # a load that knows no time adds none
        _train(agent, model, opt, 2)
    finally:
        agent.close()
    start, first, second = _lines(tmp_path)
    assert (start["e"], first["s"], second["s"]) == ("start", 41, 42)
    # The load is the delayed step's checkpoint part, once.
    assert first["c"] == pytest.approx(0.3) and first["d"] >= 0.3
    assert second["c"] == 0.0
    g = account(tmp_path)
    assert g.badput["checkpoint"] == pytest.approx(0.3, abs=1e-5)
    assert g.productive_seconds == pytest.approx(first["d"] - 0.3 + second["d"], abs=1e-5)
