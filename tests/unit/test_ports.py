"""A taken /metrics port never stops the training: python -m pytest tests/unit/test_ports.py

The local rank comes from whichever launcher started the process; a port that is taken is one
warning and a fallback whose URL is published; a sink that fails after watch() is logged once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import socket
import urllib.request
from typing import ClassVar

import pytest
import torch
from prometheus_client import CollectorRegistry

import torchvitals
from torchvitals.agent.config import Config
from torchvitals.agent.outputs.discovery import TargetFile
from torchvitals.agent.outputs.exporter import Exporter, MetricsPortError
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
from torchvitals.agent.tools.demo.launch import free_ports
from torchvitals.protocol import heartbeat_path

BLOCKS = ["a", "b"]


@contextlib.contextmanager
def held(*ports: int):
    """Listening sockets on 127.0.0.1 at ``ports`` (0: a free one); yields their ports."""
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            socks.append(s)
        yield [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def answers(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


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


def test_taken_port_falls_back_with_one_warning(caplog):
    with held(0) as (port,), caplog.at_level(logging.WARNING):
        ex = Exporter(
            BLOCKS,
            rank=2,
            local_rank=0,
            world_size=4,
            port=port,
            local_size=2,
            registry=CollectorRegistry(),
        )
        url = ex.url
        try:
            assert ex.port != port and url == f"http://127.0.0.1:{ex.port}/metrics"
            ex.update(Report(step=3, loss=1.0, grad_norm={"a": 1.0}, grad_norm_total=1.0))
            assert 'torchvitals_step{rank="2"} 3.0' in answers(ex.url)
        finally:
            ex.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert f"port {port} on 127.0.0.1 is taken" in message and url in message
    assert "metrics_port_strict" in message and "TORCHVITALS_METRICS_PORT" in message


def test_every_stride_port_taken_ends_on_any_free_port():
    # The configured port and its four fallbacks (stride 1), all held: five consecutive ports
    # that were free a moment ago; another process may take one meanwhile, so try again.
    for _ in range(5):
        tried = list(candidates(free_ports(5), 0, 1, steps=4))[:-1]
        try:
            holder = held(*tried)
            ports = holder.__enter__()
        except OSError:
            continue
        try:
            ex = Exporter(
                BLOCKS,
                rank=0,
                local_rank=0,
                world_size=1,
                port=ports[0],
                registry=CollectorRegistry(),
            )
            try:
                assert ex.port not in ports and ex.url is not None
                answers(ex.url)
            finally:
                ex.close()
        finally:
            holder.__exit__(None, None, None)
        return
    pytest.fail("found no five consecutive free ports to hold in five tries")


def test_address_this_host_lacks_serves_nothing_unless_strict(caplog):
    # 192.0.2.1 (TEST-NET-1) resolves but is no address of this host: nothing to fall back to.
    with caplog.at_level(logging.WARNING):
        ex = Exporter(
            BLOCKS,
            rank=0,
            local_rank=0,
            world_size=1,
            port=DEFAULT_PORT,
            host="192.0.2.1",
            registry=CollectorRegistry(),
        )
    assert ex.url is None and "serving no /metrics" in caplog.text.lower()
    ex.close()
    with pytest.raises(MetricsPortError) as info:
        Exporter(
            BLOCKS,
            rank=0,
            local_rank=0,
            world_size=1,
            port=DEFAULT_PORT,
            host="192.0.2.1",
            registry=CollectorRegistry(),
            strict=True,
        )
    assert info.value.errno == errno.EADDRNOTAVAIL and "192.0.2.1" in str(info.value)


def test_wildcard_bind_names_the_host_in_its_url():
    with held(0) as (port,):
        pass  # a port that was free a moment ago (or a fallback)
    ex = Exporter(
        BLOCKS,
        rank=0,
        local_rank=0,
        world_size=1,
        port=port,
        host="0.0.0.0",
        registry=CollectorRegistry(),
    )
    try:
        assert ex.url == f"http://{socket.gethostname()}:{ex.port}/metrics"
        assert ex.target == f"{socket.gethostname()}:{ex.port}"
    finally:
        ex.close()


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


def test_outputs_publish_the_fallback_url_to_file_sd(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with held(0) as (taken,):
        # The configured base + SLURM_LOCALID is the port another process holds.
        config = Config(metrics_port=taken - 1, log_dir="", metrics_file_sd_dir=str(tmp_path))
        out = Outputs(config, BLOCKS, rank=1, world_size=2, registry=CollectorRegistry())
    try:
        assert out.exporter.port != taken
        files = list(tmp_path.glob("*-rank00001.json"))
        assert len(files) == 1
        assert json.loads(files[0].read_text())[0]["targets"] == [f"127.0.0.1:{out.exporter.port}"]
    finally:
        out.close()
    assert not list(tmp_path.glob("*.json"))


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


def test_watch_beside_a_taken_port_trains_and_serves(tmp_path, monkeypatch, caplog):
    """The done-when case in one process: another process holds the configured port."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with held(0) as (port,), caplog.at_level(logging.WARNING):
        agent = torchvitals.watch(
            model, opt, metrics_port=port, log_dir="", metrics_file_sd_dir=str(tmp_path)
        )
        try:
            for _ in range(3):
                loss = model(torch.randn(2, 4)).pow(2).mean()
                loss.backward()
                agent.step(loss)
                opt.zero_grad()
            assert agent.metrics_url is not None and f":{port}/" not in agent.metrics_url
            assert 'torchvitals_steps_total{rank="0"} 3.0' in answers(agent.metrics_url)
        finally:
            agent.close()
    assert sum(f"port {port} on 127.0.0.1 is taken" in r.getMessage() for r in caplog.records) == 1
