"""Every disruption an incident, on two simulated nodes of two ranks each (torchrun c10d on
loopback, a supervisor per node, a real etcd, gloo DDP, one shared checkpoint folder): a fault is
injected once at a named global rank and step, the job recovers and finishes, and
``torchvitals incidents CKPT --json`` then holds exactly one incident, of the right kind, naming
the rank and the node it ran on (the node alone for a lost node), with the proof in its evidence,
written within the bound from the moment the job recorded the fault.

    python -m pytest tests/multinode/test_multinode_incidents.py -s    # -s: each one's timings

The truth is the job's own: each rank records the node it runs under (the supervisor's, which
c10d's arrival-order group ranks need not match), the unix time it injected its fault, and every
step's start and end (``incident_job.py``). The incidents folder is watched while the job runs,
so "written within" is the time the file first appeared, not a field the writer chose.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from cluster import PYTHONPATH, Cluster

HERE = Path(__file__).resolve().parent
INCIDENT_JOB = HERE / "incident_job.py"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(clusters):
    """Makes the test's job: 2 nodes x 2 ranks running ``incident_job.py``."""

    def make(*, job_args=(), **kwargs) -> Cluster:
        return clusters(script=INCIDENT_JOB, nproc_per_node=2, job_args=list(job_args), **kwargs)

    return make


class FirstSeen:
    """Watches the job's incidents folder from the test's side: when each file first appeared."""

    def __init__(self, ckpt: Path, poll_s: float = 0.1) -> None:
        self.folder, self.poll_s = ckpt / "incidents", poll_s
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FirstSeen:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self._look()

    def _look(self) -> None:
        with contextlib.suppress(OSError):
            for path in self.folder.glob("*.json"):
                if not path.name.startswith("."):
                    self.seen.setdefault(path.stem, time.time())

    def _run(self) -> None:
        while not self._stop.is_set():
            self._look()
            self._stop.wait(self.poll_s)


@dataclass
class Run:
    """A finished scenario: the job's records, its incidents, and the clocks around them."""

    job: Cluster
    seen: FirstSeen
    status: dict[int, int]
    wall_s: float
    incidents: list[dict] = field(default_factory=list)

    def records(self, event: str) -> list[dict]:
        return self.job.records(event)

    @property
    def fault(self) -> dict:
        (fault,) = self.records("fault")  # once, whatever the restarts
        return fault

    def written(self, incident: dict) -> float:
        """When the incident's file first appeared (the watcher's clock)."""
        return self.seen.seen[incident["key"]]

    def logs(self) -> str:
        return self.job.log(0)[-4000:] + "\n--- node 1 ---\n" + self.job.log(1)[-4000:]


def incidents_cli(ckpt: Path) -> list[dict]:
    """``torchvitals incidents CKPT --json``, as a person would run it after the job."""
    run = subprocess.run(
        [sys.executable, "-m", "torchvitals", "incidents", str(ckpt), "--json"],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout)
    assert isinstance(found, list), run.stdout[:2000]
    return found


def run(job: Cluster, timeout: float, during=None) -> Run:
    """Start the job, let ``during(job)`` act on it, wait for both nodes; the incidents after."""
    started = time.monotonic()
    with FirstSeen(job.ckpt) as seen:
        job.start()
        if during is not None:
            during(job)
        try:
            status = job.wait(timeout)
        except subprocess.TimeoutExpired:
            status = {n: p.poll() for n, p in job.procs.items()}
    result = Run(job, seen, status, time.monotonic() - started)
    assert status == {0: 0, 1: 0}, f"the job did not recover and finish: {status}\n{result.logs()}"
    result.incidents = incidents_cli(job.ckpt)
    return result


def finished_everywhere(result: Run, steps: int) -> None:
    last = max(r["attempt"] for r in result.records("finished"))
    final = [r for r in result.records("finished") if r["attempt"] == last]
    assert sorted(r["rank"] for r in final) == [0, 1, 2, 3], final
    assert {r["step"] for r in final} == {steps}


def the_incident(result: Run, kind: str) -> dict:
    """The run's one incident, which must be of ``kind`` (no other disruption was injected, so
    any other record is a false one: a symptom blamed on a bystander)."""
    kinds = [(i["kind"], i["key"], i.get("culprit"), i.get("cause")) for i in result.incidents]
    assert len(result.incidents) == 1, f"expected exactly one {kind} incident, got {kinds}"
    (incident,) = result.incidents
    assert incident["kind"] == kind, kinds
    for name in ("step", "culprit", "cause", "evidence", "detected_at", "lost_seconds"):
        assert name in incident, f"{name} missing from {incident}"
    return incident


def evidence_text(incident: dict) -> str:
    return json.dumps(incident["evidence"])


def summary(name: str, result: Run, incident: dict, fault_at: float, recovered: float | None):
    """The scenario's timings from the incident's fields and the test's own clocks."""

    def since(t):
        return None if t is None else round(t - fault_at, 1)

    trimmed = {
        k: v if k != "evidence" else evidence_text(incident)[:600] for k, v in incident.items()
    }
    print(
        f"\n[{name}] wall {result.wall_s:.1f} s; from the fault: written "
        f"{since(result.written(incident))} s, detected {since(incident['detected_at'])} s, "
        f"localized {since(incident.get('localized_at'))} s, recovered (field) "
        f"{since(incident.get('recovered_at'))} s, recovered (job's clock) {since(recovered)} s, "
        f"lost {incident.get('lost_seconds')} s\n[{name}] {json.dumps(trimmed)}"
    )


def first_step_after(result: Run, attempt: int) -> float | None:
    """When the job trained again after attempt ``attempt``: the first step a later attempt
    started."""
    later = [r["t0"] for r in result.records("step") if r["attempt"] > attempt]
    return min(later) if later else None


def assert_culprit(incident: dict, fault: dict) -> None:
    culprit = incident["culprit"]
    assert culprit.get("rank") == fault["rank"], (culprit, fault)
    assert culprit.get("node") == fault["node"], (
        f"rank {fault['rank']} ran under node {fault['node']}'s supervisor (torchrun group rank "
        f"{fault['group_rank']}), the incident says node {culprit.get('node')}"
    )


def assert_written_within(result: Run, incident: dict, fault_at: float, bound: float) -> None:
    written = result.written(incident) - fault_at
    assert 0 <= written <= bound, f"written {written:.1f} s after the fault (bound {bound} s)"
    assert fault_at - 1 <= incident["detected_at"] <= result.written(incident) + 1, incident


STEPS = 20


def test_a_stopped_rank_is_a_hang_naming_it_and_its_stopped_state(cluster):
    job = cluster(job_args=["--steps", str(STEPS), "--fault", "stop:3:12"])
    result = run(job, 200)
    finished_everywhere(result, STEPS)
    fault = result.fault
    incident = the_incident(result, "hang")
    assert_culprit(incident, fault)
    assert "stopped" in evidence_text(incident).lower(), incident["evidence"]
    assert_written_within(result, incident, fault["at"], 120)
    recovered = first_step_after(result, fault["attempt"])
    summary("stopped rank", result, incident, fault["at"], recovered)


def test_a_rank_spinning_in_user_code_is_a_hang_whose_stack_shows_the_frame(cluster):
    job = cluster(job_args=["--steps", str(STEPS), "--fault", "spin:1:12"])
    result = run(job, 200)
    finished_everywhere(result, STEPS)
    fault = result.fault
    incident = the_incident(result, "hang")
    assert_culprit(incident, fault)
    assert "spin_forever" in evidence_text(incident), incident["evidence"]
    assert_written_within(result, incident, fault["at"], 120)
    recovered = first_step_after(result, fault["attempt"])
    summary("spinning rank", result, incident, fault["at"], recovered)


EXIT_13 = re.compile(r"(exit|status|code)[^0-9,{}\[\]]{0,30}\b13\b", re.IGNORECASE)


def test_a_rank_exiting_13_is_a_crash_naming_it_and_its_exit_status(cluster):
    job = cluster(job_args=["--steps", str(STEPS), "--fault", "exit13:2:12"])
    result = run(job, 200)
    finished_everywhere(result, STEPS)
    fault = result.fault
    incident = the_incident(result, "crash")
    assert_culprit(incident, fault)
    assert EXIT_13.search(evidence_text(incident)), incident["evidence"]
    assert_written_within(result, incident, fault["at"], 60)
    recovered = first_step_after(result, fault["attempt"])
    summary("exit 13", result, incident, fault["at"], recovered)


def test_a_nan_loss_on_one_rank_is_named_and_rolled_back_by_the_agent(cluster):
    job = cluster(job_args=["--steps", str(STEPS), "--fault", "nan:3:12"])
    result = run(job, 200)
    finished_everywhere(result, STEPS)
    fault = result.fault
    # Rolled back in place: no restart, and the steps after the checkpoint done again.
    assert job.attempts(0) == job.attempts(1) == ["attempt-0001"]
    redone = [
        r for r in result.records("step") if r["t0"] > fault["at"] and r["step"] <= fault["step"]
    ]
    assert redone, "the NaN step was not rolled back"
    incident = the_incident(result, "nonfinite")
    assert_culprit(incident, fault)
    assert incident["step"] == fault["step"], incident
    assert_written_within(result, incident, fault["at"], 30)
    summary("NaN loss", result, incident, fault["at"], min(r["t0"] for r in redone))


def test_a_slow_rank_is_a_straggler_named_with_compute_as_its_cause(cluster):
    job = cluster(
        job_args=[
            "--steps",
            "24",
            "--fault",
            "slow:1:4",
            "--slow-s",
            "0.4",
            "--slow-steps",
            "12",
        ]
    )
    result = run(job, 200)
    finished_everywhere(result, 24)
    fault = result.fault
    assert job.attempts(0) == job.attempts(1) == ["attempt-0001"]
    incident = the_incident(result, "straggler")
    assert_culprit(incident, fault)
    said = (incident["cause"] + " " + evidence_text(incident)).lower()
    assert "compute" in said, incident
    assert_written_within(result, incident, fault["at"], 120)
    summary("slow rank", result, incident, fault["at"], None)


def test_a_lost_node_is_named_with_the_step_the_job_really_reached(cluster):
    steps = 40
    job = cluster(job_args=["--steps", str(steps)])
    killed: dict[str, float] = {}

    def lose_node_1(job: Cluster) -> None:
        deadline = time.monotonic() + 120
        while (job.last_healthy() or 0) < 10 or len(job.processes(1)) < 4:
            assert time.monotonic() < deadline, "the job did not reach step 10\n" + job.log(0)
            time.sleep(0.1)
        # A machine gone: its supervisor and every process under it die at once.
        tree = job.processes(1)
        killed["at"] = time.time()
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        job.procs[1].wait(10)
        while job.processes(1):
            assert time.monotonic() < deadline + 30, job.processes(1)
            time.sleep(0.1)
        # The replacement comes once the loss was seen, or after the lease (3 s) and a margin,
        # well within the survivors' wait for it (peer_timeout_s, 10 s).
        named = time.monotonic() + 6
        while time.monotonic() < named and not list((job.ckpt / "incidents").glob("node_lost*")):
            time.sleep(0.2)
        killed["replaced"] = time.time()
        job.start(1)

    result = run(job, 240, during=lose_node_1)
    finished_everywhere(result, steps)
    at = killed["at"]
    # The step the job really reached: the survivors' (node 0's ranks), before the loss.
    before = [r for r in result.records("step") if r["attempt"] == 1]
    survivors = max(r["step"] for r in before if r["node"] == 0)
    lost_ranks = max(r["step"] for r in before if r["node"] == 1)
    incident = the_incident(result, "node_lost")
    assert incident["culprit"].get("node") == 1, incident
    assert incident["culprit"].get("rank") is None, incident
    assert abs(incident["step"] - survivors) <= 1, (
        f"the incident says step {incident['step']}; node 0's ranks reached {survivors}, "
        f"node 1's {lost_ranks}"
    )
    assert_written_within(result, incident, at, 120)
    summary("lost node", result, incident, at, first_step_after(result, 1))
    print(
        f"[lost node] survivors at step {survivors}, the lost node's ranks at {lost_ranks}; "
        f"replacement started {killed['replaced'] - at:.1f} s after the kill"
    )


def test_torchrun_restarts_stuck_at_rendezvous_are_a_hang_within_the_learned_bound(cluster):
    # The supervisors at their defaults: no hang or startup timeout given. torchrun restarts
    # the workers after the SIGKILL, and every restarted worker hangs before its rendezvous;
    # only the supervisors' learned bound for a re-start (not the 600 s cold-start timeout)
    # can end it.
    job = cluster(
        timeouts=False,
        torchrun=["--max-restarts", "2"],
        job_args=["--steps", str(STEPS), "--fault", "kill:3:12", "--hang-restarts"],
    )
    result = run(job, 280)
    finished_everywhere(result, STEPS)
    fault = result.fault
    stuck = result.records("stuck")
    assert stuck, "no restarted worker hung: the scenario did not happen"
    assert {r["attempt"] for r in stuck} == {fault["attempt"]}
    # Two disruptions: the SIGKILLed rank (a crash torchrun restarted within the attempt),
    # then its restart stuck (a hang of the restarted workers, whose culprit none of them is).
    kinds = [(i["kind"], i["key"], i["culprit"]) for i in result.incidents]
    assert sorted(i["kind"] for i in result.incidents) == ["crash", "hang"], kinds
    (crash,) = [i for i in result.incidents if i["kind"] == "crash"]
    assert_culprit(crash, fault)
    assert "SIGKILL" in evidence_text(crash), crash["evidence"]
    (incident,) = [i for i in result.incidents if i["kind"] == "hang"]
    assert incident["attempt"] == fault["attempt"], incident
    recovered = first_step_after(result, fault["attempt"])
    assert recovered is not None
    stuck_since = min(r["time"] for r in stuck)
    bound = learned_bound(incident)
    # Stopped within the bound from the re-start (and a poll), the job trained again after.
    assert incident["detected_at"] - stuck_since <= bound + 5, (incident, bound)
    summary("stuck restart", result, incident, fault["at"], recovered)
    print(
        f"[stuck restart] learned bound {bound:.1f} s; the restarted workers hung from "
        f"{stuck_since - fault['at']:.1f} s after the kill; detected "
        f"{incident['detected_at'] - stuck_since:.1f} s after they hung; trained again "
        f"{recovered - fault['at']:.1f} s after the kill; incidents {kinds}"
    )


def learned_bound(incident: dict) -> float:
    """The learned re-start bound the supervisor judged by, as its evidence gives it."""
    evidence = incident["evidence"]
    for name in ("bound_s", "timeout_s", "restart_bound_s", "learned_bound_s"):
        if isinstance(evidence.get(name), (int, float)):
            return float(evidence[name])
    raise AssertionError(f"no learned bound in the evidence: {evidence}")
