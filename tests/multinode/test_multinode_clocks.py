"""Nodes whose wall clocks disagree by 30 s name the culprit that nodes with one clock would: two
simulated nodes of two ranks each (torchrun c10d on loopback, a supervisor per node, a real etcd,
gloo DDP), one node's processes (its supervisor, its torchrun, its ranks) reading a wall clock 30 s
ahead of the other's, or 30 s behind (``skewed_clock/sitecustomize.py``).

    python -m pytest tests/multinode/test_multinode_clocks.py -s

Each scenario is one where a decision by the hosts' unix times would name the wrong rank, and the
test says so from the incident's own evidence (the times each host wrote): two ranks on two nodes
dying well within the skew of each other, where the second dies only once the store holds its
node's record of the first death (the order is certain by construction); a rank whose heartbeat
stopped seconds before the others' while the job went on (``behind``); and a stopped rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import PYTHONPATH, Cluster, Etcd

from torchvitals.supervisor.blame import BEAT_SLACK_S
from torchvitals.supervisor.etcd import EtcdStore
from torchvitals.supervisor.store_schema import KEY_ROOT

HERE = Path(__file__).resolve().parent
INCIDENT_JOB = HERE / "incident_job.py"
SKEW_S = 30.0
STEPS = 16

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(clusters):
    """Makes the test's job: 2 nodes x 2 ranks running ``incident_job.py``, node 1's clock off
    by ``skew`` seconds."""

    def make(*, skew: float, steps: int = STEPS, job_args=()) -> Cluster:
        return clusters(
            script=INCIDENT_JOB,
            nproc_per_node=2,
            job_args=["--steps", str(steps), *job_args],
            skew={1: skew},
        )

    return make


def run(job: Cluster, during=None, steps: int = STEPS, timeout: float = 220) -> list[dict]:
    """Start the job, let ``during(job)`` act on it, wait for both nodes to finish its ``steps``;
    returns ``torchvitals incidents CKPT --json``."""
    job.start()
    if during is not None:
        during(job)
    try:
        status = job.wait(timeout)
    except subprocess.TimeoutExpired:
        status = {n: p.poll() for n, p in job.procs.items()}
    logs = job.log(0)[-4000:] + "\n--- node 1 ---\n" + job.log(1)[-4000:]
    assert status == {0: 0, 1: 0}, f"the job did not recover and finish: {status}\n{logs}"
    last = max(r["attempt"] for r in job.records("finished"))
    final = [r for r in job.records("finished") if r["attempt"] == last]
    assert sorted(r["rank"] for r in final) == [0, 1, 2, 3], final
    assert {r["step"] for r in final} == {steps}, final
    listed = subprocess.run(
        [sys.executable, "-m", "torchvitals", "incidents", str(job.ckpt), "--json"],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    return json.loads(listed.stdout)


def the_incident(incidents: list[dict], kind: str) -> dict:
    kinds = [(i["kind"], i["key"], i.get("culprit"), i.get("cause")) for i in incidents]
    assert len(incidents) == 1 and incidents[0]["kind"] == kind, kinds
    return incidents[0]


def fault(job: Cluster, kind: str) -> dict:
    (found,) = [r for r in job.records("fault") if r["kind"] == kind]
    return found


def assert_names(incident: dict, rank: dict) -> None:
    """The incident's culprit is the rank of this fault record, on the node it ran under."""
    culprit = incident["culprit"]
    assert (culprit.get("rank"), culprit.get("node")) == (rank["rank"], rank["node"]), (
        incident["cause"],
        rank,
    )


def assert_detected_on_its_writers_clock(job: Cluster, incident: dict, injected: dict) -> None:
    """``detected_at`` is its writer's host clock, the fault's time its rank's: once each is
    taken back to the machine's clock, the detection follows the fault."""
    writer = int(incident["writer"].rsplit(" ", 1)[1])
    detected = incident["detected_at"] - job.skew.get(writer, 0.0)
    at = injected["at"] - job.skew.get(injected["node"], 0.0)
    assert at - 1 <= detected <= time.time() + 1, (incident, injected)


def wait_for_death_record(etcd: Etcd, job: Cluster, pid: int, timeout: float = 60) -> None:
    """Until the store holds a node's record of the death of ``pid`` (its supervisor saw it)."""
    store = EtcdStore(etcd.url)
    deadline = time.monotonic() + timeout
    while not any(
        e.key.endswith(f"/{pid}") for e in store.prefix(f"{KEY_ROOT}{job.job}/rank_deaths/")
    ):
        assert time.monotonic() < deadline, f"no record of the death of pid {pid}"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("skew", "first_node"),
    [(SKEW_S, 1), (-SKEW_S, 0)],
    ids=["first-death-on-the-node-30s-ahead", "second-death-on-the-node-30s-behind"],
)
def test_the_rank_that_died_first_is_named_though_the_clocks_say_the_other(
    cluster, etcd, skew, first_node
):
    # Node ``first_node``'s local rank 0 exits 13 after step 8; the other node's local rank 0
    # exits 7 once the store holds the first death. Their node-mates stay out of any collective
    # and outlive both (they end by SIGTERM after), so neither node's launcher exits, and no
    # node asks for findings, before both deaths were seen.
    second_node = 1 - first_node
    job = cluster(
        skew=skew,
        job_args=[
            *("--fault", f"exit13:{first_node}.0:8"),
            *("--fault", f"gated:{second_node}.0:8"),
            *("--fault", f"hold:{first_node}.1:8"),
            *("--fault", f"hold:{second_node}.1:8"),
        ],
    )

    def open_the_gate(job: Cluster) -> None:
        deadline = time.monotonic() + 120
        while not [r for r in job.records("fault") if r["kind"] == "exit13"]:
            assert time.monotonic() < deadline, "the first rank never failed\n" + job.log(0)
            time.sleep(0.05)
        wait_for_death_record(etcd, job, fault(job, "exit13")["pid"])
        (job.ckpt / "gate").write_text("")

    incidents = run(job, during=open_the_gate)
    first, second = fault(job, "exit13"), fault(job, "gated")
    assert (first["node"], second["node"]) == (first_node, second_node)
    incident = the_incident(incidents, "crash")
    assert_names(incident, first)
    assert incident["evidence"]["exit_status"] == 13, incident["evidence"]
    deaths = {d["rank"]: d for d in incident["evidence"]["deaths"]}
    assert {first["rank"], second["rank"]} <= set(deaths), deaths
    assert deaths[first["rank"]]["revision"] < deaths[second["rank"]]["revision"]
    assert deaths[second["rank"]]["status"] == 7
    # The hosts' clocks say the opposite: by the unix times each node wrote, the second rank
    # died first (the skew is far wider than the time between the deaths).
    assert deaths[second["rank"]]["at"] < deaths[first["rank"]]["at"], deaths
    assert_detected_on_its_writers_clock(job, incident, first)
    print(f"\n[crash, node 1 {skew:+.0f} s] {incident['cause']}; deaths {list(deaths.values())}")


@pytest.mark.parametrize(
    ("skew", "frozen_node"),
    [(SKEW_S, 1), (-SKEW_S, 0)],
    ids=["behind-on-the-node-30s-ahead", "behind-beside-the-node-30s-behind"],
)
def test_the_rank_whose_heartbeat_stopped_first_is_behind_though_the_clocks_say_otherwise(
    cluster, skew, frozen_node
):
    # Node ``frozen_node``'s local rank 0 stops writing its heartbeat after step 4 and trains on
    # for 6 s, then waits in a barrier no other rank enters: every rank waits in a collective,
    # and only its heartbeat's step and age tell it apart. Steps of 0.2 s at least: the job is
    # far from done when the barrier comes.
    steps = 60
    job = cluster(
        skew=skew,
        steps=steps,
        job_args=["--fault", f"freeze:{frozen_node}.0:4", "--freeze-s", "6", "--sleep", "0.2"],
    )
    incidents = run(job, steps=steps, timeout=260)
    frozen = fault(job, "freeze")
    incident = the_incident(incidents, "hang")
    assert incident["evidence"]["rule"] == "behind", incident["cause"]
    assert_names(incident, frozen)
    ranks = {r["rank"]: r for r in incident["evidence"]["ranks"]}
    mine = ranks.pop(frozen["rank"])
    assert mine["step"] < min(r["step"] for r in ranks.values()), incident["evidence"]["ranks"]
    # By the unix times each host wrote, its heartbeat is not older than the others' by the
    # slack: the ages (each host's own clock against itself) are what tell.
    assert mine["beat_time"] >= min(r["beat_time"] for r in ranks.values()) - BEAT_SLACK_S
    assert mine["beat_age_s"] > max(r["beat_age_s"] for r in ranks.values()) + BEAT_SLACK_S
    assert_detected_on_its_writers_clock(job, incident, frozen)
    print(f"\n[behind, node 1 {skew:+.0f} s] {incident['cause']}")


def test_a_stopped_rank_on_the_node_30s_behind_is_named(cluster):
    job = cluster(skew=-SKEW_S, job_args=["--fault", "stop:1.0:8"])
    incidents = run(job)
    stopped = fault(job, "stop")
    incident = the_incident(incidents, "hang")
    assert incident["evidence"]["rule"] == "stopped", incident["cause"]
    assert_names(incident, stopped)
    assert_detected_on_its_writers_clock(job, incident, stopped)
    print(f"\n[stopped, node 1 {-SKEW_S:+.0f} s] {incident['cause']}")
