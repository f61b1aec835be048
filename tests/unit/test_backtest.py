"""``torchvitals backtest``: a past run's log through the live detector, as a user calls it.

The replay drives the same ``Detector`` the agent runs, so these tests check what the replay adds:
episodes (a page per firing, not per step), the summary, the JSON object, the exit codes, the
Python API over records. Torch-free: the detector and the readers import no torch.
"""

from __future__ import annotations

import gzip
import json
import math
import random

import pytest

import torchvitals
from torchvitals.__main__ import main
from torchvitals.agent.detect import Detector, Thresholds
from torchvitals.agent.tools.backtest.logs import LogError, LogPoint, Series
from torchvitals.agent.tools.backtest.replay import backtest, replay, report_of


def curve(steps=3000, seed=0, spikes=(), jump_at=None, grad_spikes=()):
    """A falling, noisy loss with a grad norm: one-step spikes at ``spikes``, a jump that stays
    from ``jump_at``, grad-norm spikes at ``grad_spikes``."""
    rng = random.Random(seed)
    rows = []
    for s in range(1, steps + 1):
        loss = 2.5 + 8.0 * math.exp(-s / 150) + 0.02 * rng.gauss(0, 1)
        norm = 0.3 * (1 + 0.1 * rng.gauss(0, 1))
        if s in spikes:
            loss *= 1.6
        if jump_at is not None and s >= jump_at:
            loss *= 1.5
        if s in grad_spikes:
            norm *= 6
        rows.append({"step": s, "loss": loss, "grad_norm": norm, "lr": 3e-4})
    return rows


def test_a_healthy_run_raises_nothing():
    result = backtest(curve())
    assert (result.steps, result.first_step, result.last_step) == (3000, 1, 3000)
    assert result.episodes == [] and result.pages == 0 and result.warnings == 0
    assert result.columns == {"loss", "grad_norm", "lr"}


def test_a_spike_that_heals_is_a_warning_and_one_that_stays_is_one_page():
    result = backtest(curve(spikes=(1200,), jump_at=2000))
    found = [(e.pattern, e.severity, e.step) for e in result.episodes]
    assert found == [
        ("loss_outlier", "warning", 1200),
        ("loss_outlier", "warning", 2000),
        ("loss_spike", "critical", 2001),
    ]
    page = result.episodes[-1]
    # The detector emits the critical verdict every step it holds (the watchdog acts on each);
    # a backtest without the watchdog counts the firing once, held to the end of the log.
    assert (page.until, page.held) == (3000, 1000)
    assert (result.pages, result.warnings) == (1, 2)
    assert result.per_100k(result.pages) == pytest.approx(1e5 / 3000)


def test_a_grad_norm_spike_without_a_loss_move_is_a_warning():
    result = backtest(curve(grad_spikes=(900, 2500)))
    assert [(e.pattern, e.step) for e in result.episodes] == [
        ("grad_spike", 900),
        ("grad_spike", 2500),
    ]
    assert result.episodes[0].evidence["ratio"] > Thresholds().grad_spike_factor


def test_a_slow_divergence_over_thousands_of_steps_is_named_as_such():
    rows = curve(steps=6000)
    for row in rows[3000:]:  # +0.01% a step from 3000: +35% by the end, never a spike
        row["loss"] *= 1.0001 ** (row["step"] - 3000)
    result = backtest(rows)
    assert [(e.pattern, e.severity) for e in result.episodes] == [("loss_divergence", "warning")]
    divergence = result.episodes[0]
    assert 3000 < divergence.step < 5000 and divergence.until == 6000
    assert divergence.evidence["rise"] >= Thresholds().loss_divergence_rise


def test_warmup_is_not_a_spike():
    rows = curve(steps=2000)
    for row in rows[:200]:  # a loss that creeps up while the LR warms up, then falls fast
        row["loss"] = 10.0 + 0.004 * row["step"]
    assert backtest(rows).episodes == []


def test_the_replay_judges_every_step_exactly_as_the_detector_does():
    rows = curve(spikes=(700, 701, 1500), grad_spikes=(1100,))
    detector = Detector([], [], Thresholds())
    live = []
    for row in rows:
        point = LogPoint(row["step"], row["loss"], row["grad_norm"], row["lr"])
        live += detector.observe(report_of(point))
    firsts = {(v.pattern, v.step) for v in live if v.pattern}
    replayed = backtest(rows)
    assert {(e.pattern, e.step) for e in replayed.episodes} <= firsts
    assert [(e.pattern, e.step) for e in replayed.episodes] == [
        ("loss_outlier", 700),
        ("loss_spike", 701),
        ("grad_spike", 1100),
        ("loss_outlier", 1500),
    ]


def test_a_nonfinite_loss_pages_and_a_missing_one_is_no_evidence():
    points = [LogPoint(s, 3.0 + 0.01 * (s % 3), 0.5) for s in range(1, 200)]
    points[100] = LogPoint(101, None, None)  # the line had no loss: an overflow-skipped step
    points[150] = LogPoint(151, math.nan, math.inf)
    series = Series(points=points, files=["x.log"], columns={"loss", "grad_norm"}, notes=[])
    result = replay(series)
    assert [(e.pattern, e.step, e.held) for e in result.episodes] == [
        ("nonfinite_grad", 151, 1),
        ("nonfinite_loss", 151, 1),
    ]
    assert result.pages == 2


def test_the_json_object_is_what_the_issue_of_a_pager_needs():
    out = backtest(curve(spikes=(1200,)), detect={"loss_spike_mads": 6.0}).to_dict()
    assert {"steps", "first_step", "last_step", "verdicts", "pages", "warnings"} <= set(out)
    (verdict,) = out["verdicts"]
    assert verdict["step"] == 1200 and verdict["pattern"] == "loss_outlier"
    assert verdict["severity"] == "warning" and verdict["loss"] > verdict["threshold"]
    json.dumps(out, allow_nan=False)  # strict JSON: no NaN leaks


def test_the_api_reads_files_and_names_bad_thresholds(tmp_path):
    path = tmp_path / "run.csv"
    path.write_text("step,loss\n" + "".join(f"{r['step']},{r['loss']}\n" for r in curve()))
    assert torchvitals.backtest(str(path)).steps == 3000
    assert torchvitals.backtest([path]).steps == 3000
    with pytest.raises(torchvitals.ConfigError, match="loss_spike_madz"):
        torchvitals.backtest(str(path), detect={"loss_spike_madz": 3})


def write_log(tmp_path, rows, name="run.csv.gz"):
    path = tmp_path / name
    with gzip.open(path, "wt") as f:
        f.write("step,loss,grad_norm\n")
        f.writelines(f"{r['step']},{r['loss']},{r['grad_norm']}\n" for r in rows)
    return path


def test_cli_prints_the_summary_by_pattern_and_exits_0(tmp_path, capsys):
    path = write_log(tmp_path, curve(spikes=(1200, 2400), jump_at=2800))
    assert main(["backtest", str(path)]) == 0
    out = capsys.readouterr().out
    assert "read 3000 logged steps (1-3000)" in out
    assert "1 page (33.3 per 100k steps)" in out and "loss_spike x1: steps 2801-3000" in out
    assert "3 warnings (100 per 100k steps)" in out
    assert "loss_outlier x3: steps 1200, 2400, 2800" in out


def test_cli_pieces_of_a_resumed_run_and_json(tmp_path, capsys):
    rows = curve()
    first = write_log(tmp_path, rows[:1600], "a.csv.gz")
    resumed = [dict(r, loss=r["loss"] * (1.6 if r["step"] == 1700 else 1)) for r in rows[1499:]]
    second = write_log(tmp_path, resumed, "b.csv.gz")  # resumed from 1500: overlaps 1500-1600
    assert main(["backtest", str(first), str(second), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["steps"], out["first_step"], out["last_step"]) == (3000, 1, 3000)
    assert [(v["pattern"], v["step"]) for v in out["verdicts"]] == [("loss_outlier", 1700)]
    assert any("1500" in note for note in out["notes"])


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"step,acc\n1,0.5\n", "no loss column"),
        (b"\x00\x01garbage\xff" * 40, "run.csv"),
        (None, "no such file"),
    ],
)
def test_cli_bad_input_is_one_line_naming_the_file_and_exit_2(tmp_path, capsys, content, problem):
    path = tmp_path / "run.csv"
    if content is not None:
        path.write_bytes(content)
    assert main(["backtest", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("torchvitals backtest: ") and str(path) in line and problem in line


def test_cli_bad_detect_overrides_exit_2(tmp_path, capsys):
    path = write_log(tmp_path, curve(steps=100))
    assert main(["backtest", str(path), "--detect", "{not json"]) == 2
    assert "--detect is not JSON" in capsys.readouterr().err
    assert main(["backtest", str(path), "--detect", '{"loss_spike_mads": -1}']) == 2
    assert "detect.loss_spike_mads=-1" in capsys.readouterr().err


def test_a_log_error_is_a_torchvitals_error():
    with pytest.raises(torchvitals.TorchvitalsError) as info:
        backtest("/nonexistent/run.csv")
    assert isinstance(info.value, LogError) and "/nonexistent/run.csv" in str(info.value)


def test_cli_names_every_format_and_refuses_an_unknown_one(tmp_path, capsys):
    from torchvitals.__main__ import parse_args
    from torchvitals.agent.tools.backtest.logs import FORMATS

    with pytest.raises(SystemExit):
        parse_args(["backtest", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert all(f in shown for f in FORMATS)
    path = write_log(tmp_path, curve(steps=100))
    assert main(["backtest", str(path), "--format", "parquet"]) == 2
    err = capsys.readouterr().err
    assert "format='parquet'" in err and "one of auto, csv, tsv" in err
