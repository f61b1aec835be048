"""watch() on ranks that differ: every rank refuses together, with the same error naming the
rank and what differs, or every rank starts; never a transport error, a hang or one rank alone
in a collective (each scenario ends with a barrier every rank must reach)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from agreement_ranks import (
    bad_signal_on_one_rank,
    folder_per_rank,
    port_taken_on_one_rank,
    sample_every_differs,
    two_trainings,
    world_group,
)
from support.world import free_port, run_world


def _same_everywhere(outcomes: list[tuple[str, str, str]]) -> tuple[str, str]:
    kinds = {(kind, text) for kind, text, _ in outcomes}
    assert len(kinds) == 1, f"the ranks raised different errors: {outcomes}"
    return next(iter(kinds))


def test_a_setting_that_differs_between_ranks_is_named_on_every_rank():
    kind, text = _same_everywhere(run_world(sample_every_differs))
    assert kind == "SettingsDifferError", text
    # The setting, each value with its ranks, and where each value came from.
    assert "sample_every: 10 on rank 0" in text, text
    assert "3 on rank 1" in text and "TORCHVITALS_SAMPLE_EVERY='3'" in text, text
    assert "TORCHVITALS_SAMPLE_EVERY='10'" in text, text
    assert "sample_every" in text.split("|")[0] and "detect." not in text, text


def _two_free_ports() -> int:
    while True:
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
                return base
            except OSError:
                continue


def test_a_strict_port_taken_on_one_rank_stops_every_rank_naming_it():
    base = _two_free_ports()
    outcomes = run_world(port_taken_on_one_rank, base)
    kind, text = _same_everywhere(outcomes)
    assert kind == "RankFailedError", text
    assert "watch() failed on rank 1" in text and f"{base + 1}" in text, text
    assert "MetricsPortError" in text and "1 of 2 failed" in text, text
    # The failed rank's own error is the cause of its copy; rank 0 had none.
    assert outcomes[1][2] == "MetricsPortError" and outcomes[0][2] == "NoneType", outcomes


def test_a_rank_failing_after_the_collectives_of_watch_stops_every_rank():
    kind, text = _same_everywhere(run_world(bad_signal_on_one_rank))
    assert kind == "RankFailedError", text
    assert "rank 1" in text and "finishing watch()" in text and "TypeError" in text, text


def test_a_checkpoint_folder_that_is_not_shared_is_refused_on_every_rank(tmp_path):
    kind, text = _same_everywhere(run_world(folder_per_rank, str(tmp_path)))
    assert kind == "CheckpointError", text
    assert "not one folder shared by every rank" in text and "rank 1 (host" in text, text
    assert "NFS" in text, text  # the fix
    assert not list((tmp_path / "node-0").glob(".shared-*")), "the marker stays behind"


@pytest.mark.slow
@pytest.mark.parametrize("explicit", [True, False], ids=["group=", "default group"])
def test_two_trainings_in_one_job_are_refused_on_every_rank(explicit):
    outcomes = run_world(two_trainings, explicit, world=4, timeout=240)
    kind, text = _same_everywhere(outcomes)
    assert kind == "RankFailedError", text
    assert "4 of 4 failed" in text and "one training per job" in text, text
    if explicit:
        assert "names ranks [0, 1] of the job's 4" in text, text
        assert "names ranks [2, 3] of the job's 4" in text, text
    else:
        assert "two independent trainings" in text, text


def test_a_group_over_the_whole_world_is_taken_and_rank_0_alone_writes_the_log(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("LOGS", str(tmp_path))
    ranks = run_world(world_group)
    assert [r["global_rank"] for r in ranks] == [0, 1]
    assert [r["group_rank"] for r in ranks] == [0, 1]
    assert [r["writes_records"] for r in ranks] == [True, False]
    assert ranks[1]["run_dir"] is None
    events = Path(ranks[0]["run_dir"]) / "events.jsonl"
    steps = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["step"] for e in steps if e.get("event") == "step"] == [1, 2]
