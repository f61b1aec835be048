"""`torchvitals demo` end to end: 2 spawned gloo ranks, a real fault, the real detector and
watchdog, then the run report rendered from the recorded run. Plus the launcher's promise that a
dying rank ends the demo with a clear message instead of a hang."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchvitals.__main__ import main
from torchvitals.agent.tools.demo.launch import RankFailed, wait_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLOTS = ("loss", "grad_norm", "update_ratio", "activations")


def _demo(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    out = str(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "torchvitals", "demo", "--out", out, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, out


@pytest.fixture(scope="module")
def lr_spike(tmp_path_factory):
    return _demo(tmp_path_factory.mktemp("demo-lr-spike"), "--fault", "lr-spike", "--steps", "80")


@pytest.mark.slow
@pytest.mark.distributed
def test_lr_spike_is_warned_then_rolled_back_and_the_run_ends_healthy(lr_spike):
    proc, out = lr_spike
    stdout = proc.stdout
    assert "\x1b" not in stdout, "escape codes in piped output"
    assert len(re.findall(r"curl -s http://127\.0\.0\.1:\d+/metrics", stdout)) == 2, stdout
    lines = stdout.splitlines()
    first = {
        kind: next(
            (i for i, line in enumerate(lines) if line.strip().startswith(kind) and what in line),
            None,
        )
        for kind, what in (
            ("WARNING", "hot_lr"),
            ("CRITICAL", "loss_spike"),
            ("ROLLBACK", "back to the healthy checkpoint"),
        )
    }
    assert None not in first.values(), stdout
    # The early warning comes before the critical verdict, and the rollback right after it.
    assert first["WARNING"] < first["CRITICAL"] < first["ROLLBACK"], first

    ledger = json.loads(Path(os.path.join(out, "checkpoints", "ledger.json")).read_text())
    rollbacks = [e for e in ledger["entries"] if e["event"] == "rollback"]
    assert len(rollbacks) == 1, ledger
    rb = rollbacks[0]
    assert "loss_spike" in rb["reason"] and rb["lr_scale"] == 0.5 and ledger["lr_scale"] < 1
    start, stop = rb["skipped"]
    assert start < stop and ledger["skipped"] == [[start, stop]]
    checkpoints = [e["step"] for e in ledger["entries"] if e["event"] == "checkpoint"]
    assert rb["to_step"] in checkpoints and rb["to_step"] < rb["step"]

    summary = json.loads(Path(os.path.join(out, "summary.json")).read_text())
    assert summary["steps"] == 80 and summary["rollbacks"] == 1 and summary["healthy_at_end"], (
        summary
    )
    assert summary["lr_scale"] == 0.5 and summary["skipped"] == [[start, stop]], summary
    assert "finished healthy" in stdout and f"report: {out}/report.html" in stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_report_of_the_recorded_run_has_plots_and_names_the_fault(lr_spike):
    import matplotlib.image

    _, out = lr_spike
    html = Path(os.path.join(out, "report.html")).read_text(encoding="utf-8")
    for name in PLOTS:
        path = os.path.join(out, f"{name}.png")
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100, (name, pixels.shape)
        assert pixels.std() > 0.01, f"{name}.png is blank"
        assert f"src='{name}.png'" in html
    # The diagnosis comes from diagnose_events on the log: the LR spike shows as a gradient
    # explosion led by the update ratio's hot_lr, with the loss spike as evidence.
    assert "cause: gradient explosion" in html and "hot_lr" in html and "loss_spike" in html
    assert "lr-spike after step 44" in html and "rollback</b> to step" in html


@pytest.mark.slow
@pytest.mark.distributed
def test_report_command_renders_a_run_folder_again(lr_spike, tmp_path, capsys):
    _, out = lr_spike
    assert main(["report", out]) == 0
    printed = capsys.readouterr().out
    assert "cause: gradient explosion" in printed and "rollback at step" in printed
    assert main(["report", str(tmp_path)]) == 2  # no event log there
    assert "events.jsonl" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.distributed
def test_nan_on_one_rank_is_rolled_back_and_diagnosed_as_numerical(tmp_path):
    proc, out = _demo(tmp_path, "--fault", "nan", "--steps", "40")
    assert "CRITICAL step 23: nonfinite_loss" in proc.stdout, proc.stdout
    ledger = json.loads(Path(os.path.join(out, "checkpoints", "ledger.json")).read_text())
    assert [(e["step"], e["to_step"]) for e in ledger["entries"] if e["event"] == "rollback"] == [
        (23, 20)
    ], ledger
    html = Path(os.path.join(out, "report.html")).read_text(encoding="utf-8")
    assert "cause: numerical instability" in html and "nonfinite_loss" in html


def test_demo_refuses_a_folder_that_holds_a_run(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("")
    assert main(["demo", "--out", str(tmp_path)]) == 2
    assert "holds a run already" in capsys.readouterr().err


def _exit_soon(code: int) -> None:
    time.sleep(0.5)
    os._exit(code)


def _hang() -> None:
    time.sleep(300)  # a peer blocked in a collective, as far as the parent can tell


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_dying_rank_stops_the_others_and_is_named(how):
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_hang),
        ctx.Process(
            target=_exit_soon if how == "exit" else _hang, args=(3,) if how == "exit" else ()
        ),
    ]
    for p in procs:
        p.start()
    if how == "sigkill":
        time.sleep(0.5)
        procs[1].kill()
    with pytest.raises(RankFailed) as caught:
        wait_ranks(procs, timeout_s=120, grace_s=1.0)
    expected = "rank 1 exited with status 3" if how == "exit" else "rank 1 was killed by SIGKILL"
    assert str(caught.value) == expected
    assert not any(p.is_alive() for p in procs)  # the hanging peer was stopped
