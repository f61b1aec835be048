"""The detector's defaults on real public training logs (tests/curves/, sources in its manifest).

    python -m pytest tests/unit/test_backtest_curves.py

Each log is replayed by ``torchvitals.backtest`` with the default thresholds. The healthy runs
must raise nothing (no page, no warning); every event labelled in the manifest, read off the
numbers by a person, must be found: a finding that starts within three logged steps of it (or,
for a jump or a divergence, anywhere until it ends). ``KNOWN_MISSES`` are the events the
defaults do not find, each with why; a change that finds one more fails here until the list
shrinks, a change that loses one fails here too.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import torchvitals
from torchvitals.agent.tools.backtest.logs import read_logs

CURVES = Path(__file__).resolve().parents[1] / "curves"
MANIFEST = json.loads((CURVES / "manifest.json").read_text())
LONGER = {"jump", "divergence", "persistent_spike"}
"""Event kinds that last: found anywhere from their start to their end (``until``, or the end of
the log when None)."""

NOISE = "a one-step spike within this run's per-batch noise (its loss moves 6% step to step)"
KNOWN_MISSES = {
    ("bigscience_gpt_52b_perf_fp16", 3): "at step 3, inside the 10 warm-up steps: no baseline yet",
    ("megatron_mixtral_8x7b_release", 2360): "11% above the median: below the 12% floor "
    "(loss_spike_floor 0.02 x 6); at 0.015 the healthy AdamW run warns 4 times",
    ("megatron_mixtral_8x7b_release", 2830): "12% above the median, at the floor",
    **{
        ("modded_nanogpt_scaleup_1p5b", step): NOISE
        for step in (9248, 11155, 11647, 12535, 15228, 16428, 16698, 18605)
    },
}


def run_name(entry) -> str:
    return entry["file"].split(".")[0]


def replayed(entry):
    return torchvitals.backtest(CURVES / entry["file"])


def test_every_file_in_the_folder_is_in_the_manifest_with_its_source():
    listed = {e["file"] for e in MANIFEST}
    present = {p.name for p in CURVES.iterdir() if p.name.endswith(".gz")}
    assert listed == present
    for entry in MANIFEST:
        assert entry["source"]["repo"] or entry["source"]["url"], entry["file"]
        assert entry["source"]["license"], entry["file"]


@pytest.mark.parametrize("entry", [e for e in MANIFEST if e["healthy"]], ids=run_name)
def test_a_healthy_run_neither_pages_nor_warns(entry):
    result = replayed(entry)
    assert result.steps == entry["steps"]
    assert [(e.pattern, e.step) for e in result.episodes] == []


@pytest.mark.parametrize("entry", [e for e in MANIFEST if e["events"]], ids=run_name)
def test_every_labelled_event_is_found_but_the_known_misses(entry):
    result = replayed(entry)
    stride = max(1, (entry["last_step"] - entry["first_step"]) // max(1, entry["steps"] - 1))
    starts = [e.step for e in result.episodes]
    missed = set()
    for event in entry["events"]:
        end = event["step"]
        if event["kind"] in LONGER:
            end = event["until"] if event["until"] is not None else entry["last_step"]
        if not any(event["step"] - 3 * stride <= s <= end + 3 * stride for s in starts):
            missed.add((run_name(entry), event["step"]))
    known = {k for k in KNOWN_MISSES if k[0] == run_name(entry)}
    assert missed == known


def test_a_run_of_one_step_spikes_warns_and_does_not_page_for_each():
    """The noisiest real per-batch loss: its one-step spikes are warnings; only two bad batches
    within three steps page (once in 20k steps)."""
    (entry,) = [e for e in MANIFEST if run_name(e) == "modded_nanogpt_scaleup_1p5b"]
    result = replayed(entry)
    assert result.pages == 1 and result.episodes and result.warnings > 60
    assert {e.pattern for e in result.episodes} == {"loss_outlier", "loss_spike"}


def test_a_megatron_log_reads_as_its_table():
    """The original Megatron-DeepSpeed lines and the CSV made from them are the same series."""
    for entry in MANIFEST:
        if not entry["file"].endswith(".log.gz"):
            continue
        table = CURVES / entry["file"].replace(".log.gz", ".csv.gz")
        lines, rows = read_logs([CURVES / entry["file"]]), read_logs([table])
        assert lines.points == rows.points and lines.columns == rows.columns
        with gzip.open(CURVES / entry["file"], "rt") as f:
            assert sum("iteration" in line for line in f) >= len(rows.points)
