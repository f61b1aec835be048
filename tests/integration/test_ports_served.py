"""A taken /metrics port never stops the training, on real sockets: a taken port is one warning
and a fallback along the node's stride (then any free port) whose URL is published to file_sd;
an address this host lacks serves nothing unless strict; a wildcard bind names the host.

    python -m pytest tests/integration/test_ports_served.py
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import socket
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry

import torchvitals
from torchvitals.agent.config import Config
from torchvitals.agent.outputs.exporter import Exporter, MetricsPortError
from torchvitals.agent.outputs.ports import (
    DEFAULT_PORT,
    candidates,
)
from torchvitals.agent.outputs.sinks import Outputs
from torchvitals.agent.report import Report
from torchvitals.agent.tools.demo.ports import free_ports

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
