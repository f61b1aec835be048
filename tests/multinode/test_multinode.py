"""One job on two simulated nodes (two torchrun agents on loopback, a supervisor per node, a real
etcd, gloo, one shared checkpoint folder): restarts agreed across the nodes, a lost node named,
one job identity. Every scenario ends with no process of it left.

    python -m pytest tests/multinode/test_multinode.py

Each test prints its time to recovery or to the stop (``-s`` shows them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cluster import JOB, PYTHONPATH, free_port

from torchvitals import protocol

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(clusters):
    return clusters


def wait_until(predicate, timeout: float, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"not within {timeout} s")


def test_a_new_job_in_a_finished_jobs_folder_is_refused_once_and_never_retried(cluster):
    first = cluster("job-a", job_args=["--steps", "6"])
    first.start()
    assert first.wait() == {0: 0, 1: 0}, first.log(0)[-3000:] + first.log(1)[-3000:]
    second = cluster("job-b", job_args=["--steps", "6"])
    started = time.monotonic()
    second.start()
    status = second.wait()
    took = time.monotonic() - started
    assert status == {0: protocol.REFUSED_EXIT_CODE, 1: protocol.REFUSED_EXIT_CODE}, second.log(0)[
        -3000:
    ]
    log = second.log(0) + second.log(1)
    assert "belongs to job 'job-a', not to this job 'job-b'" in log
    assert "refused to resume" in log
    # Once: no second attempt on either node, and the old run was not continued.
    assert second.attempts(0) == second.attempts(1) == ["attempt-0001"]
    assert [r["step"] for r in second.records("finished")] == [6, 6]
    print(f"\nrefused: both nodes stopped {took:.1f} s after the start, exit 78")


def test_a_killed_rank_restarts_both_nodes_together_and_both_resume_at_the_same_step(cluster):
    job = cluster(job_args=["--fault", "kill", "--fault-rank", "1", "--fault-step", "12"])
    job.start()
    assert job.wait() == {0: 0, 1: 0}, job.log(0)[-3000:] + job.log(1)[-3000:]
    killed = (job.ckpt / "fault-kill-done").stat().st_mtime
    # One restart of the whole job: attempt 2 on both nodes, none more.
    assert job.attempts(0) == job.attempts(1) == ["attempt-0001", "attempt-0002"]
    resumed = [r for r in job.records("resumed") if r["attempt"] == 2]
    assert sorted(r["rank"] for r in resumed) == [0, 1]
    assert {r["step"] for r in resumed} == {10}
    assert [r["step"] for r in job.records("finished")] == [20, 20]
    recovery = max(r["time"] for r in resumed) - killed
    print(f"\nrank SIGKILLed: both nodes resumed at step 10 {recovery:.1f} s after the kill")


def test_a_killed_supervisor_stops_its_job_and_the_other_node_names_the_lost_node(cluster):
    job = cluster(job_args=["--steps", "400"])
    job.start()
    wait_until(lambda: (job.last_healthy() or 0) >= 10, 120)
    wait_until(lambda: len(job.processes(1)) >= 3, 10)  # supervisor, torchrun, its rank
    job.procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # Its launcher dies with it (parent-death signal), and the rank with the launcher.
    wait_until(lambda: not job.processes(1), 30)
    orphaned_for = time.monotonic() - killed
    status = job.procs[0].wait(60)
    stopped = time.monotonic() - killed
    assert status == protocol.NODE_LOST_EXIT_CODE, job.log(0)[-3000:]
    log = job.log(0)
    assert "node 1 (host " in log and " lost at step " in log, log[-3000:]
    assert "no node took its place within 10 s" in log
    # The bound: the lease (3 s) + the wait for a replacement (10 s) + the stop (grace 3 s).
    assert stopped < 3 + 10 + 3 + 5, stopped
    print(
        f"\nsupervisor SIGKILLed: its job gone after {orphaned_for:.1f} s; the other node "
        f"exited 79 {stopped:.1f} s after the kill"
    )


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("torchvitals_supervisor_")
    }


def test_a_node_lost_for_good_is_named_and_the_job_stops_within_the_bound(cluster):
    # The whole of node 1 freezes (a machine gone: no process exits, no connection resets):
    # node 0's rank waits in a collective, and only node 1's expired lease tells.
    port = free_port()
    job = cluster(job_args=["--steps", "400"], metrics_port=port)
    job.start()
    wait_until(lambda: (job.last_healthy() or 0) >= 10, 120)
    node1 = wait_until(lambda: len(job.processes(1)) >= 3 and job.processes(1), 10)
    before = scrape(port)
    # Node 0 publishes its own presence only; the job's view is the nodes it sees.
    assert before['torchvitals_supervisor_node_present{node="0"}'] == 1
    assert not [
        k
        for k in before
        if k.startswith("torchvitals_supervisor_node_present{")
        and k != 'torchvitals_supervisor_node_present{node="0"}'
    ]
    assert (
        before["torchvitals_supervisor_nodes_present"]
        == before["torchvitals_supervisor_nodes_expected"]
        == 2
    )
    for proc in node1:
        proc.suspend()
    frozen = time.monotonic()
    seen = wait_until(lambda: "lost at step" in job.log(0), 30)
    named = time.monotonic() - frozen
    waiting = wait_until(
        lambda: (m := scrape(port))["torchvitals_supervisor_waiting_for_peers"] and m, 10
    )
    assert waiting['torchvitals_supervisor_node_present{node="0"}'] == 1
    assert waiting["torchvitals_supervisor_nodes_present"] == 1
    assert waiting["torchvitals_supervisor_nodes_expected"] == 2
    assert not job.processes(0)[1:], "node 0's launcher still runs while it waits"
    status = job.procs[0].wait(60)
    stopped = time.monotonic() - frozen
    for proc in node1:
        proc.kill()
    job.procs[1].wait(10)
    wait_until(lambda: not job.processes(1), 30)
    assert seen and status == protocol.NODE_LOST_EXIT_CODE, job.log(0)[-3000:]
    log = job.log(0)
    assert "node 1 (host " in log and "no node took its place within 10 s" in log
    # Named within the lease (3 s), a poll, and etcd's expiry sweep (a margin for a busy
    # machine); stopped after the wait for a replacement (10 s).
    assert named < 3 + 0.2 + 4, named
    assert stopped < 3 + 10 + 3 + 5, stopped
    print(
        f"\nnode lost for good: named {named:.1f} s after it froze; the job stopped with 79 "
        f"{stopped:.1f} s after"
    )


def hold(tmp_path) -> tuple[list[str], Path]:
    """The job's flags that hold every rank after step 14 (the checkpoint of step 10 committed)
    until the test creates the returned file: a 30-step job would otherwise finish in about two
    seconds, before a test slowed by a busy machine has lost its node."""
    go = tmp_path / "go"
    return ["--hold-at", "14", "--hold-file", str(go)], go


def test_a_replaced_node_joins_and_the_job_resumes_without_an_extra_restart(cluster, tmp_path):
    held, go = hold(tmp_path)
    job = cluster(job_args=["--steps", "30", *held])
    job.start()
    wait_until(lambda: (job.last_healthy() or 0) >= 10, 120)
    job.procs[1].send_signal(signal.SIGKILL)
    job.procs[1].wait(10)
    go.touch()
    wait_until(lambda: not job.processes(1), 30)
    replaced = time.time()
    job.start(1)  # a fresh pod: a new supervisor, node 1
    assert job.wait() == {0: 0, 1: 0}, job.log(0)[-3000:] + job.log(1)[-3000:]
    assert job.attempts(0) == ["attempt-0001", "attempt-0002"]
    assert job.attempts(1) == ["attempt-0001", "attempt-0002"]  # the old one's, the new one's
    resumed = [r for r in job.records("resumed") if r["attempt"] == 2]
    assert sorted(r["rank"] for r in resumed) == [0, 1] and len({r["step"] for r in resumed}) == 1
    assert [r["step"] for r in job.records("finished")] == [30, 30]
    recovery = max(r["time"] for r in resumed) - replaced
    print(
        f"\nreplaced node: the job resumed at step {resumed[0]['step']} {recovery:.1f} s after "
        "the new supervisor started"
    )


def test_torchrun_elastic_restarts_under_the_supervisors_finish_the_job(cluster):
    # Rank 0 waits outside any collective while rank 1's agent restarts rank 1, so its own
    # agent restarts it for the new rendezvous round: a membership change, which torch does not
    # count (TORCHELASTIC_RESTART_COUNT stays 0 there). On a busy machine torch's restarted
    # workers sometimes never finish their rendezvous; then the supervisors' startup timeout
    # restarts both nodes together, which must finish the job as well.
    job = cluster(
        torchrun=["--max-restarts", "2"],
        supervise=["--startup-timeout-s", "40"],
        job_args=[
            "--fault",
            "kill",
            "--fault-rank",
            "1",
            "--fault-step",
            "12",
            "--others-pause",
            "5",
        ],
    )
    job.start()
    assert job.wait() == {0: 0, 1: 0}, job.log(0)[-3000:] + job.log(1)[-3000:]
    killed = (job.ckpt / "fault-kill-done").stat().st_mtime
    log = job.log(0) + job.log(1)
    # Without the job id, the rank no counter calls restarted refused the folder.
    assert "ResumeRefused" not in log and "refused to resume" not in log
    assert job.attempts(0) == job.attempts(1)  # whoever restarted, both nodes agreed
    resumed = [r for r in job.records("resumed") if r["step"] is not None]
    last = max(r["attempt"] for r in resumed)
    final = {r["rank"]: r for r in resumed if r["attempt"] == last}
    assert sorted(final) == [0, 1] and {r["step"] for r in final.values()} == {10}
    assert [r["step"] for r in job.records("finished")] == [20, 20]
    by_torchrun = job.attempts(0) == ["attempt-0001"]
    # Which counts torch gives is its race (rank 0 restarted for the new round: 0; failed in a
    # collective first: 1); a 0 is the case the restart counter alone refused.
    counts = {rank: r["elastic_restart"] for rank, r in sorted(final.items())}
    print(
        f"\ntorchrun elastic restart ({'torchrun' if by_torchrun else 'the supervisors'} "
        f"recovered, restart counts {counts}): both ranks resumed at step 10 "
        f"{max(r['time'] for r in final.values()) - killed:.1f} s after the kill"
    )


def test_a_stopped_rank_is_a_hang_and_both_nodes_restart_together(cluster):
    job = cluster(job_args=["--fault", "stop", "--fault-rank", "1", "--fault-step", "12"])
    job.start()
    assert job.wait() == {0: 0, 1: 0}, job.log(0)[-3000:] + job.log(1)[-3000:]
    stopped = (job.ckpt / "fault-stop-done").stat().st_mtime
    assert job.attempts(0) == job.attempts(1) == ["attempt-0001", "attempt-0002"]
    resumed = [r for r in job.records("resumed") if r["attempt"] == 2]
    assert sorted(r["rank"] for r in resumed) == [0, 1] and {r["step"] for r in resumed} == {10}
    print(
        f"\nrank SIGSTOPped: both nodes resumed at step 10 "
        f"{max(r['time'] for r in resumed) - stopped:.1f} s after the stop"
    )


def test_a_job_of_1_to_2_nodes_goes_on_with_one_and_trains_as_a_single_node_resume_would(
    cluster, tmp_path
):
    port = free_port()
    held, go = hold(tmp_path)
    job = cluster(
        supervise=["--min-nodes", "1"],
        metrics_port=port,
        torchrun=["--rdzv-conf", "last_call_timeout=5"],
        job_args=["--steps", "30", *held],
    )
    job.command_nnodes = "1:2"
    job.start()
    wait_until(lambda: (job.last_healthy() or 0) >= 10, 120)
    job.procs[1].send_signal(signal.SIGKILL)
    job.procs[1].wait(10)
    go.touch()
    killed = time.monotonic()
    # Node 0 waits for a replacement: the folder it will resume from, copied for the reference.
    wait_until(lambda: scrape(port)["torchvitals_supervisor_waiting_for_peers"], 30)
    shutil.copytree(job.ckpt, tmp_path / "reference")
    assert job.procs[0].wait(120) == 0, job.log(0)[-3000:]
    shrunk = time.monotonic() - killed
    assert "the job goes on with 1 of 2 nodes (0): the world size changes" in job.log(0)
    assert "was saved by 2 ranks, now 1" in job.log(0)
    (after,) = [r for r in job.records("resumed") if r["attempt"] == 2]
    (finished,) = [r for r in job.records("finished") if r["attempt"] == 2]
    assert finished["step"] == 30
    # The same checkpoint resumed by a plain single-node job: the same losses, step by step.
    env = {
        **os.environ,
        "PYTHONPATH": PYTHONPATH,
        "TORCHVITALS_JOB_ID": job.job,
        "OMP_NUM_THREADS": "1",
    }
    reference = tmp_path / "reference.jsonl"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            str(JOB),
            "--ckpt",
            str(tmp_path / "reference"),
            "--out",
            str(reference),
            "--steps",
            "30",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in reference.read_text().splitlines()]
    assert records[0]["step"] == after["step"]
    assert records[1]["losses"] == finished["losses"]
    print(
        f"\nshrink 2 -> 1 node: resumed at step {after['step']} on one node "
        f"{after['time'] - time.time() + time.monotonic() - killed:.1f} s after the kill; "
        f"finished {shrunk:.1f} s after it"
    )
