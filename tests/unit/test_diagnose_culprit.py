"""The diagnosis leads with the culprit: python -m pytest tests/unit/test_diagnose_culprit.py

Runs are written with the real writers (the agent's EventLog of step Reports, the IncidentLog the
supervisors and rank 0 write) into the folders a job leaves: the run folder, and a checkpoint
folder that may lie elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from torchvitals.__main__ import main
from torchvitals.agent.detect import CRITICAL, WARNING, Verdict
from torchvitals.agent.outputs.eventlog import EventLog
from torchvitals.agent.report import Report
from torchvitals.agent.tools.diagnose import diagnose_events
from torchvitals.records.incidents import Culprit, Incident, IncidentLog
from torchvitals.records.ledger import Ledger

NAN = math.nan
T0 = 1_700_000_000.0


def write_events(path, verdicts=(), nan_at=None, nan_ranks=(), steps=60):
    """A healthy run whose loss goes NaN at ``nan_at`` (on ``nan_ranks``), with ``verdicts``."""
    by_step: dict[int, list] = {}
    for v in verdicts:
        by_step.setdefault(v.step, []).append(v.to_dict())
    with EventLog(path) as log:
        for step in range(1, steps + 1):
            bad = nan_at is not None and step == nan_at
            log.write(
                Report(
                    step=step,
                    loss=NAN if bad else 2.0 / math.sqrt(step),
                    grad_norm={"layers.0": 1.0},
                    grad_norm_total=1.0,
                    nonfinite=bad,
                    nonfinite_loss=bad,
                    nonfinite_ranks=list(nan_ranks) if bad else [],
                    verdicts=by_step.get(step, []),
                )
            )


def incident(kind, key, step, at, **culprit):
    return Incident(
        kind=kind,
        key=key,
        step=step,
        culprit=Culprit(**culprit),
        cause=f"{kind} seen by the test",
        detected_at=T0 + at,
        writer="test",
    )


NAN_VERDICT = Verdict("nonfinite_loss", CRITICAL, 41, None, {"loss": NAN})


def test_an_incident_in_the_run_folder_leads_the_diagnosis(tmp_path):
    run = tmp_path / "run"
    write_events(run / "events.jsonl", [NAN_VERDICT], nan_at=41)
    log = IncidentLog(run)
    log.record(incident("nonfinite", "nonfinite-a0000-s00000041", 41, 5, rank=1, node=0, host="h"))
    d = diagnose_events(run / "events.jsonl")
    lines = d.render().splitlines()
    assert lines[0] == "culprit: rank 1 (node 0, host h): non-finite loss at step 41"
    assert lines[1] == "  nonfinite seen by the test"
    assert lines[2].startswith("cause: numerical instability")
    assert "incidents:" in lines


def test_the_job_folder_elsewhere_is_found_by_job_dir_or_by_the_ledger(tmp_path):
    run, ckpt = tmp_path / "runs" / "r", tmp_path / "ckpt"
    write_events(run / "events.jsonl")
    IncidentLog(ckpt).record(incident("hang", "hang-a0002", 30, 1, rank=3, node=1, host="h1"))
    # The run folder alone knows nothing of it.
    assert diagnose_events(run / "events.jsonl").culprit is None
    named = diagnose_events(run / "events.jsonl", job_dirs=[ckpt])
    assert named.render().splitlines()[0] == "culprit: rank 3 (node 1, host h1): hung at step 30"
    # The watchdog's ledger lives in the checkpoint folder: naming it names the job folder.
    ledger = ckpt / "ledger.json"
    Ledger(ledger).load().record_checkpoint(20, ckpt / "step-20")
    assert (
        diagnose_events(run, ledger=ledger).culprit == "rank 3 (node 1, host h1): hung at step 30"
    )
    with pytest.raises(NotADirectoryError, match="--job-dir"):
        diagnose_events(run / "events.jsonl", job_dirs=[tmp_path / "typo"])


def test_the_incident_of_the_diagnosed_cause_leads_then_one_that_stopped_the_job(tmp_path):
    run = tmp_path / "run"
    write_events(run / "events.jsonl", [NAN_VERDICT], nan_at=41)
    log = IncidentLog(run)
    log.record(incident("straggler", "straggler-a0000-r2-s00000010", 10, 1, rank=2, node=1))
    log.record(incident("hang", "hang-a0000", 20, 2, rank=0, node=0))
    log.record(incident("nonfinite", "nonfinite-a0000-s00000041", 41, 3, rank=1, node=0))
    d = diagnose_events(run / "events.jsonl")
    assert d.cause == "numerical instability"
    assert d.culprit == "rank 1 (node 0): non-finite loss at step 41"
    assert len(d.incidents) == 3 and d.incidents[0].startswith("straggler at step 10")
    # Without the non-finite record, the hang (it stopped the job) leads over the earlier
    # straggler (it only slowed it).
    (run / "incidents" / "nonfinite-a0000-s00000041.json").unlink()
    assert diagnose_events(run / "events.jsonl").culprit == "rank 0 (node 0): hung at step 20"


def test_a_non_finite_record_is_called_what_its_verdicts_called_it(tmp_path):
    run = tmp_path / "run"
    write_events(run / "events.jsonl")  # the step's own report was not logged
    grad = Verdict("nonfinite_grad", CRITICAL, 41, "layers.0", {"blocks": ["layers.0"]})
    record = incident("nonfinite", "nonfinite-a0000-s00000041", 41, 5, rank=1, node=0)
    IncidentLog(run).record(replace(record, evidence={"verdicts": [grad.to_dict()]}))
    assert diagnose_events(run).culprit == "rank 1 (node 0): non-finite gradient at step 41"


def test_a_lost_node_is_named_by_its_node(tmp_path):
    run = tmp_path / "run"
    write_events(run / "events.jsonl")
    IncidentLog(run).record(incident("node_lost", "node_lost-a0001-n1", 25, 1, node=1, host="n1"))
    assert diagnose_events(run).culprit == "node 1 (host n1): node lost at step 25"


def test_without_incidents_the_verdicts_evidence_names_the_rank(tmp_path):
    run = tmp_path / "run"
    straggler = Verdict(
        "straggler", WARNING, 30, None, {"rank": 2, "seconds": 0.5, "others_mean": 0.1}
    )
    write_events(run / "events.jsonl", [straggler])
    d = diagnose_events(run / "events.jsonl")
    assert d.cause == "straggler" and d.render().startswith("culprit: rank 2: straggler at step 30")
    # A non-finite verdict: the ranks its evidence names, else the step report's
    # nonfinite_ranks (the ranks whose own loss was NaN).
    ranked = Verdict("nonfinite_loss", CRITICAL, 41, None, {"loss": NAN, "ranks": [3, 1]})
    write_events(tmp_path / "a" / "events.jsonl", [ranked], nan_at=41)
    d = diagnose_events(tmp_path / "a" / "events.jsonl")
    assert d.culprit == "rank 3: non-finite loss at step 41 (also rank 1)"
    write_events(tmp_path / "b" / "events.jsonl", [NAN_VERDICT], nan_at=41, nan_ranks=[1])
    d = diagnose_events(tmp_path / "b" / "events.jsonl")
    assert d.culprit == "rank 1: non-finite loss at step 41"
    # Nothing names a rank: no culprit line, the diagnosis starts with the cause.
    write_events(tmp_path / "c" / "events.jsonl", [NAN_VERDICT], nan_at=41)
    d = diagnose_events(tmp_path / "c" / "events.jsonl")
    assert d.culprit is None and d.render().startswith("cause: numerical instability")


def test_a_gradient_spike_names_the_rank_whose_activations_were_far_out(tmp_path):
    spike = Verdict(
        "grad_spike",
        "warning",
        30,
        "layers.0",
        {"ratio": 4.0, "ranks": [1], "rank_count": 1, "culprit_from": "activations"},
    )
    write_events(tmp_path / "events.jsonl", [spike])
    d = diagnose_events(tmp_path / "events.jsonl")
    assert d.culprit == "rank 1: gradient spike at step 30", d.render()


def test_an_unreadable_record_is_named_and_the_others_still_lead(tmp_path):
    run = tmp_path / "run"
    write_events(run / "events.jsonl")
    IncidentLog(run).record(incident("crash", "crash-a0001", 12, 1, rank=2, node=1))
    (run / "incidents" / "crash-a0002.json").write_text("{not json")
    d = diagnose_events(run)
    assert d.culprit == "rank 2 (node 1): crashed at step 12"
    assert any(
        line.startswith("unreadable: ") and "crash-a0002.json" in line for line in d.incidents
    )


def test_cli_diagnose_takes_the_job_folder(tmp_path, capsys, monkeypatch):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    write_events(run / "events.jsonl")
    IncidentLog(ckpt).record(incident("crash", "crash-a0001", 12, 1, rank=2, node=1, host="h"))
    assert main(["diagnose", str(run / "events.jsonl"), "--job-dir", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("culprit: rank 2 (node 1, host h): crashed at step 12\n")
    assert main(["diagnose", str(run), "--job-dir", str(tmp_path / "typo")]) == 2
    assert "--job-dir" in capsys.readouterr().err
    # From the environment too; the argument wins over it.
    monkeypatch.setenv("TORCHVITALS_DIAGNOSE_JOB_DIR", str(ckpt))
    assert main(["diagnose", str(run)]) == 0
    assert capsys.readouterr().out.startswith("culprit: rank 2")
    assert main(["diagnose", str(run), "--job-dir", str(run)]) == 0
    assert capsys.readouterr().out.startswith("cause: no anomaly")


def test_an_incident_naming_nobody_does_not_lead_the_diagnosis():
    from torchvitals.agent.tools.culprit import from_incidents
    from torchvitals.records.incidents import Culprit, Incident

    spike = Incident(
        kind="loss_spike",
        key="loss_spike-a0000-s00000118",
        step=118,
        culprit=Culprit(),
        cause="the loss spiked; the rank cannot be told from the mean loss",
        detected_at=1000.0,
    )
    assert from_incidents([spike], "gradient_explosion") is None
    named = Incident(
        kind="straggler",
        key="straggler-a0000-r1-s00000004",
        step=9,
        culprit=Culprit(rank=1, node=0, host="h"),
        cause="rank 1 is slow",
        detected_at=1001.0,
    )
    lead = from_incidents([spike, named], "gradient_explosion")
    assert lead is not None and lead.line.startswith("rank 1 (node 0, host h)")
