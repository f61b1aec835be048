"""``torchvitals goodput`` agrees with the time measured from the job's own step log, on a
supervised run with a crash and a rollback, and its parts add up to its wall time.

    python -m pytest tests/integration/test_goodput_agreement.py -s

One node, torchrun's two gloo ranks under ``torchvitals supervise``, one checkpoint folder: rank
1's loss is NaN once (the agent rolls back to the last healthy checkpoint, the steps after it are
done again), then rank 1 exits 13 (the supervisor restarts the job from the last healthy
checkpoint, the steps after it are done again). The job writes each step's start and end
(``tests/multinode/incident_job.py``); the reference is computed from that alone: a step
execution is productive when its step number is above every step number completed before it
(else it is work done again), and the wall time runs from before the supervisor started to after
it exited, by this test's clock.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "multinode" / "incident_job.py"
PYTHONPATH = os.pathsep.join(p for p in (str(ROOT.parent), os.environ.get("PYTHONPATH")) if p)
STEPS = 40
NAN, CRASH = "nan:1:8", "exit13:1:28"
WORK_S = 0.3
"""Seconds of work per step: enough that productive time is a real share of the wall (the two
starts cost some 30 s on a shared machine), so the agreement is not won by a ratio near 0."""

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchvitals", *args],
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def measured(records: list[dict]) -> tuple[float, float, list[tuple[int, int]]]:
    """Productive and redone seconds from rank 0's step log, and each execution's (attempt,
    step), in the order they ran."""
    steps = sorted((r for r in records if r["rank"] == 0), key=lambda r: r["t1"])
    productive = redone = 0.0
    done = 0
    for r in steps:
        if r["step"] > done:
            productive += r["t1"] - r["t0"]
            done = r["step"]
        else:
            redone += r["t1"] - r["t0"]
    return productive, redone, [(r["attempt"], r["step"]) for r in steps]


def test_goodput_agrees_with_the_step_log_after_a_crash_and_a_rollback(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.jsonl"
    command = [
        "supervise",
        "--checkpoint-dir",
        str(ckpt),
        "--heartbeat-root",
        str(tmp_path / "hb"),
        "--poll-s",
        "0.1",
        "--grace-s",
        "3",
        "--backoff-s",
        "0.1",
        "--hang-timeout-s",
        "8",
        "--startup-timeout-s",
        "90",
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.2",
        str(JOB),
        "--ckpt",
        str(ckpt),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--sleep",
        str(WORK_S),
        "--fault",
        NAN,
        "--fault",
        CRASH,
    ]
    before = time.time()
    run = cli(*command, timeout=240)
    wall = time.time() - before
    assert run.returncode == 0, run.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    finished = [r for r in records if r["event"] == "finished"]
    assert sorted(r["rank"] for r in finished) == [0, 1] and {r["step"] for r in finished} == {
        STEPS
    }
    # Both faults fired, once each, and both cost steps done again.
    assert sorted(r["kind"] for r in records if r["event"] == "fault") == ["exit13", "nan"]
    assert {r["attempt"] for r in finished} == {2}, (
        f"not one restart, for the exit 13: {finished}\n{run.stderr[-4000:]}"
    )
    productive, redone, order = measured([r for r in records if r["event"] == "step"])
    assert redone > 0, order
    reference = productive / wall

    report = cli("goodput", str(ckpt), "--json")
    assert report.returncode == 0, report.stderr[-3000:]
    got = json.loads(report.stdout)
    print(
        f"\ngoodput: measured {reference:.3f} (productive {productive:.1f} s, redone "
        f"{redone:.1f} s, wall {wall:.1f} s); torchvitals goodput says {json.dumps(got)[:1500]}"
    )
    assert math.isclose(
        got["productive_seconds"] + sum(got["badput"].values()),
        got["wall_seconds"],
        rel_tol=1e-6,
    ), got
    assert abs(got["goodput"] - reference) <= max(0.05, reference / 4), (
        f"torchvitals goodput {got['goodput']:.3f}, measured {reference:.3f}"
    )
    assert math.isclose(got["goodput"], got["productive_seconds"] / got["wall_seconds"]), got
    # The work done again is badput of its own, as much as the step log says was redone.
    lost = got["badput"]["lost_progress"]
    assert abs(lost - redone) <= max(1.0, redone / 2), (lost, redone)

    # The two disruptions are incidents naming rank 1, each with what it cost.
    incidents = json.loads(cli("incidents", str(ckpt), "--json").stdout)
    kinds = sorted((i["kind"], i["culprit"]["rank"]) for i in incidents)
    assert kinds == [("crash", 1), ("nonfinite", 1)], incidents
