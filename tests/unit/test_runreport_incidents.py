"""The run report draws the incidents and the badput: python -m pytest
tests/unit/test_runreport_incidents.py

A run written with the real writers: the agent's EventLog in the run folder, and in a checkpoint
folder elsewhere the IncidentLog records and the goodput timelines the supervisor
(SupervisorTimeline) and global rank 0 (StepTimeline) append. The figures on the page are the
accounting's own (``goodput.account``), the culprits the records'.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.image import imread

from torchvitals.agent.outputs.eventlog import EventLog
from torchvitals.agent.report import Report
from torchvitals.agent.tools.incidentplots import goodput_html, incidents_html
from torchvitals.agent.tools.jobrecords import read_job_records
from torchvitals.agent.tools.runreport import write_report
from torchvitals.records.goodput import CAUSES, account
from torchvitals.records.incidents import Culprit, Incident, IncidentLog
from torchvitals.records.timeline import StepTimeline, SupervisorTimeline

T0 = 1_700_000_000.0
RED, ORANGE = (0xD6, 0x27, 0x28), (0xE6, 0x9F, 0x00)
"""The timeline's markers: an incident that stopped the job, one that slowed it."""


def write_run(run, ckpt) -> None:
    """250 steps over two attempts: attempt 1 trains steps 1..90 and hangs (rank 3, node 1),
    attempt 2 resumes from step 80 and trains to 250; rank 2 straggles at step 40."""
    with EventLog(run / "events.jsonl") as log:
        for step in range(1, 91):
            log.write(Report(step=step, loss=2.0 / math.sqrt(step), grad_norm={"layers.0": 1.0}))
    node = SupervisorTimeline(ckpt, node=0)
    node.waited(1, start=T0, end=T0 + 2)
    first = StepTimeline(ckpt, attempt=1, pid=101)
    first.start(at=T0 + 5, resumed=0)
    for step in range(1, 91):
        first.step(step, end=T0 + 5 + step, seconds=1.0, data_wait=0.1)
    node.attempt(1, start=T0 + 2, end=T0 + 110, reason="hang", status=-9, detected=T0 + 100)
    node.waited(2, start=T0 + 110, end=T0 + 112)
    second = StepTimeline(ckpt, attempt=2, pid=202)
    second.start(at=T0 + 125, resumed=80, load_seconds=2.0)
    for n, step in enumerate(range(81, 251), start=1):
        second.step(step, end=T0 + 125 + n, seconds=1.0)
    node.attempt(2, start=T0 + 112, end=T0 + 300, reason="exit", status=0)
    node.ended(at=T0 + 301, code=0)
    for timeline in (node, first, second):
        timeline.close()
    incidents = IncidentLog(ckpt)
    incidents.record(
        Incident(
            kind="straggler",
            key="straggler-a0001-r2-s00000040",
            step=40,
            culprit=Culprit(rank=2, node=1, host="h1"),
            cause="rank 2 computes 3x slower than the others (compute)",
            detected_at=T0 + 45,
        )
    )
    incidents.record(
        Incident(
            kind="hang",
            key="hang-a0001",
            step=90,
            culprit=Culprit(rank=3, node=1, host="h1", pid=4711),
            cause="rank 3 is stopped (SIGSTOP)",
            detected_at=T0 + 100,
            localized_at=T0 + 103,
            recovered_at=T0 + 126,
        )
    )


def has_color(png, rgb, tolerance=12) -> bool:
    pixels = (imread(png)[..., :3] * 255).astype(int)
    return bool((np.abs(pixels - np.array(rgb)).max(axis=-1) <= tolerance).any())


def test_the_report_draws_the_incidents_and_the_badput_of_a_job_folder_elsewhere(tmp_path):
    run, ckpt = tmp_path / "runs" / "r", tmp_path / "ckpt"
    write_run(run, ckpt)
    report = write_report(run, job_dirs=[ckpt])
    figures = account(ckpt)
    assert [i.key for i in report.incidents] == ["straggler-a0001-r2-s00000040", "hang-a0001"]
    assert report.goodput == figures
    timeline, badput = report.images["incidents"], report.images["badput"]
    assert timeline == run / "incidents.png" and badput == run / "badput.png"
    # A red marker for the hang (it stopped the job), an orange one for the straggler.
    assert has_color(timeline, RED) and has_color(timeline, ORANGE)
    assert has_color(badput, (0x2C, 0xA0, 0x2C))  # the productive part of the wall time
    page = report.html.read_text()
    assert "<h2>incidents</h2>" in page and "<img src='incidents.png'" in page
    assert "rank 3 (node 1, host h1), pid 4711" in page and "rank 3 is stopped (SIGSTOP)" in page
    assert "<td>3.0 s</td><td>26.0 s</td>" in page  # localized after, recovered after
    assert f"goodput <b>{figures.goodput:.1%}</b>" in page and "<img src='badput.png'" in page
    for cause in CAUSES:
        assert f"<tr><th>{cause}</th><td>{figures.badput[cause]:.1f} s</td>" in page
    summary = report.render_summary()
    assert f"goodput {figures.goodput:.1%} of {figures.wall_seconds:.1f} s wall" in summary
    assert "incident: hang at step 90: rank 3 (node 1, host h1, pid 4711)" in summary
    # The diagnosis leads with the hang: it stopped the job, the straggler only slowed it.
    assert report.diagnosis.culprit == "rank 3 (node 1, host h1): hung at step 90"


def test_without_the_job_folder_the_sections_say_where_they_looked(tmp_path):
    run, ckpt = tmp_path / "runs" / "r", tmp_path / "ckpt"
    write_run(run, ckpt)
    records = read_job_records(run)
    assert records.folders == (run,) and not records.incidents and records.goodput is None
    incidents = incidents_html(records, None)
    assert f"no incident records (looked in {run}" in incidents and "--job-dir" in incidents
    assert "no goodput records" in goodput_html(records, None)
    # Named, the checkpoint folder is looked in first.
    assert read_job_records(run, [ckpt]).folders == (ckpt, run)
