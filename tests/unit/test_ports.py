"""Where /metrics goes, without binding anything: the local rank from whichever launcher
started the process, the candidate ports along the node's stride, the file_sd target file, and
sinks or a heartbeat folder that fail after watch() never reaching the step. (The ports bound for
real: tests/integration/test_ports_served.py.)

    python -m pytest tests/unit/test_ports.py
"""

from __future__ import annotations

import errno
import json
import logging
from typing import ClassVar

import pytest
from prometheus_client import CollectorRegistry

from torchvitals.agent.config import Config
from torchvitals.agent.outputs.discovery import TargetFile
from torchvitals.agent.outputs.ports import (
    DEFAULT_PORT,
    UNKNOWN_LOCAL_SIZE,
    candidates,
    local_rank,
    local_rank_source,
    local_size,
)
from torchvitals.agent.outputs.sinks import Outputs
from torchvitals.agent.recover.heartbeat import Heartbeat
from torchvitals.agent.report import Report
from torchvitals.protocol import heartbeat_path

BLOCKS = ["a", "b"]


@pytest.mark.parametrize(
    "env, rank, source",
    [
        ({"LOCAL_RANK": "3", "SLURM_LOCALID": "5"}, 3, "LOCAL_RANK"),  # torchrun first
        ({"SLURM_LOCALID": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "6"}, 5, "SLURM_LOCALID"),  # srun
        (
            {"OMPI_COMM_WORLD_LOCAL_RANK": "6", "MPI_LOCALRANKID": "7"},
            6,
            "OMPI_COMM_WORLD_LOCAL_RANK",
        ),  # Open MPI
        ({"MPI_LOCALRANKID": "7"}, 7, "MPI_LOCALRANKID"),  # MPICH, Intel MPI
        ({"LOCAL_RANK": "", "SLURM_LOCALID": "2"}, 2, "SLURM_LOCALID"),  # empty is unset
        ({}, 0, ""),
    ],
)
def test_local_rank_from_every_launcher_in_order(env, rank, source):
    assert local_rank(env) == rank
    assert local_rank_source(env) == source


def test_unreadable_local_rank_is_named_and_skipped(caplog):
    with caplog.at_level(logging.WARNING):
        assert local_rank({"LOCAL_RANK": "x", "SLURM_LOCALID": "1"}) == 1
    assert "LOCAL_RANK='x'" in caplog.text


def test_local_size_from_launchers():
    assert local_size({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_size({"SLURM_NTASKS_PER_NODE": "2(x3)", "OMPI_COMM_WORLD_LOCAL_SIZE": "6"}) == 6
    assert local_size({}) == UNKNOWN_LOCAL_SIZE


def test_candidates_step_by_the_node_width_then_any_port():
    # Local rank 1 of 4: its own port, then the same slot one node-width up, never a sibling's.
    assert list(candidates(19400, 1, 4, steps=3)) == [19401, 19405, 19409, 19413, 0]
    siblings = {19400 + r for r in range(4)}
    assert not siblings & set(list(candidates(19400, 1, 4))[1:])
    assert list(candidates(65534, 1, 8)) == [65535, 0]


def test_default_port_is_no_well_known_exporters():
    # dcgm-exporter 9400, node-exporter 9100, the 9100-9999 exporter range; torchrun's
    # rendezvous 29400 and master 29500; Linux's ephemeral range from 32768.
    assert Config().metrics_port == DEFAULT_PORT == 19400
    for r in range(16):
        port = DEFAULT_PORT + r
        assert not 9100 <= port <= 9999 and port not in (29400, 29500) and port < 32768


def test_target_file_is_what_file_sd_reads(tmp_path):
    target = TargetFile(tmp_path / "sd", rank=3, host="node7")
    assert target.write("node7:19403", scheme="https", job="my-run")
    assert target.path.name == "node7-rank00003.json"
    assert json.loads(target.path.read_text()) == [
        {"targets": ["node7:19403"], "labels": {"__scheme__": "https", "job": "my-run"}}
    ]
    assert target.write("node7:19403")
    assert json.loads(target.path.read_text()) == [{"targets": ["node7:19403"], "labels": {}}]
    assert not list((tmp_path / "sd").glob("*.tmp"))
    target.remove()
    target.remove()
    assert not target.path.exists()


def test_unwritable_target_folder_is_a_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        assert not TargetFile(blocker / "sd", rank=0).write("h:1")
    assert "file_sd target" in caplog.text


class Broken:
    def __init__(self) -> None:
        self.calls = 0

    def write(self, *_: object) -> None:
        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    write_event = update = write

    def close(self) -> None:
        pass


class NoVerdicts:
    active: ClassVar[dict] = {}

    def active_counts(self) -> dict:
        return {}


def test_a_failing_sink_never_raises_into_the_step(caplog):
    out = Outputs(
        Config(metrics_port=0, log_dir=""),
        BLOCKS,
        rank=0,
        world_size=1,
        registry=CollectorRegistry(),
    )
    out.events = out.live = Broken()
    report = Report(step=1, loss=1.0, grad_norm={"a": 1.0}, grad_norm_total=1.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            out.publish(report, NoVerdicts(), None)
        out.event({"validation_loss": 1.0})
    assert out.failures == {"event log": 4, "live view": 3}
    logged = [r for r in caplog.records if "failed; the training goes on" in r.getMessage()]
    assert len(logged) == 2 and all(r.exc_info for r in logged)  # once per sink, traceback
    out.close()


def test_heartbeat_carries_the_metrics_url_and_survives_a_lost_folder(tmp_path, caplog):
    beat = Heartbeat(tmp_path / "hb", rank=4, interval_s=0.0)
    beat.metrics_url = "http://127.0.0.1:19404/metrics"
    beat.beat(1)
    record = json.loads(heartbeat_path(tmp_path / "hb", 4).read_text())
    assert record["metrics_url"] == "http://127.0.0.1:19404/metrics" and record["step"] == 1
    for path in (tmp_path / "hb").iterdir():
        path.unlink()
    (tmp_path / "hb").rmdir()
    with caplog.at_level(logging.WARNING):
        beat.beat(2)
        beat.beat(3)
    assert caplog.text.count("cannot write the heartbeat") == 1
