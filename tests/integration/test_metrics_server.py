"""/metrics on a shared node: bounded under abuse, TLS with client certificates.

    python -m pytest tests/integration/test_metrics_server.py -q

The real exporter on a free loopback port; abusive clients are real sockets, and the TLS
certificates are made by openssl for each run.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from torchvitals.agent.outputs.exporter import Exporter
from torchvitals.agent.outputs.server import WORKERS
from torchvitals.agent.outputs.tls import TLS
from torchvitals.agent.report import Report
from torchvitals.agent.tools.demo.launch import free_ports


def report(step: int) -> Report:
    return Report(step=step, loss=1.0 / step, grad_norm={"a": 1.0}, grad_norm_total=1.0)


def metric_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("torchvitals-metrics")]


def scrape(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=10, context=context) as r:
        return r.read().decode()


def test_idle_connections_and_a_scrape_loop_hold_no_threads_and_no_render_per_scrape():
    ex = Exporter(
        ["a"],
        rank=0,
        local_rank=0,
        world_size=1,
        port=free_ports(1),
        max_connections=16,
        idle_timeout_s=1.0,
        limit=None,  # the render cache alone bounds the renders of a loop that is answered
    )
    idle = []
    try:
        ex.update(report(1))
        for _ in range(200):
            idle.append(socket.create_connection(("127.0.0.1", ex.port), timeout=5))
        time.sleep(0.2)
        # 200 connections that say nothing: a file descriptor each at most, never a thread.
        assert len(metric_threads()) <= 1 + WORKERS, metric_threads()
        assert "torchvitals_loss" in scrape(ex.url), "a real scraper gets in past the idle ones"
        held = len(ex._server._waiting) + ex._server._busy
        assert held <= 16, held

        # A tight scrape loop while training steps: one render per step, not one per scrape.
        renders, scrapes, stop = ex.cache.renders, [], threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                scrape(ex.url)
                scrapes.append(1)

        loops = [threading.Thread(target=hammer) for _ in range(2)]
        for t in loops:
            t.start()
        began = time.monotonic()
        for step in range(2, 7):
            time.sleep(0.1)
            ex.update(report(step))
        time.sleep(0.1)
        stop.set()
        for t in loops:
            t.join(10)
        elapsed = time.monotonic() - began
        assert len(scrapes) > 20, len(scrapes)
        bound = 5 + 2 + int(elapsed / ex.cache.min_interval_s) + 1
        assert ex.cache.renders - renders <= bound, (ex.cache.renders - renders, len(scrapes))
        assert len(metric_threads()) <= 1 + WORKERS

        # Idle connections are closed after the idle timeout.
        time.sleep(2.5)
        closed = 0
        for s in idle:
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == len(idle)
    finally:
        for s in idle:
            s.close()
        ex.close()
    assert not metric_threads()


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed, and a
    client certificate signed by nobody the server trusts."""
    d = tmp_path_factory.mktemp("certs")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=tv-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN=tv-{name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            f"{name}.pem",
            *(["-extfile", "san.ext"] if name == "server" else []),
            cwd=d,
        )
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=stranger",
        "-keyout",
        "stranger.key",
        "-out",
        "stranger.pem",
        cwd=d,
    )
    return d


def client(certs, cert: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if cert:
        ctx.load_cert_chain(str(certs / f"{cert}.pem"), str(certs / f"{cert}.key"))
    return ctx


def test_tls_with_client_certificates(certs):
    tls = TLS(
        certfile=str(certs / "server.pem"),
        keyfile=str(certs / "server.key"),
        client_cafile=str(certs / "ca.pem"),
        client_auth_required=True,
    )
    ex = Exporter(["a"], rank=0, local_rank=0, world_size=1, port=free_ports(1), tls=tls)
    try:
        ex.update(report(1))
        assert ex.url.startswith("https://127.0.0.1:")
        assert "torchvitals_loss" in scrape(ex.url, client(certs, "client"))
        for who in (None, "stranger"):
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                scrape(ex.url, client(certs, who))
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            scrape(ex.url.replace("https://", "http://"))
        # A failed handshake costs the server nothing lasting: the next scraper is served.
        assert "torchvitals_loss" in scrape(ex.url, client(certs, "client"))
    finally:
        ex.close()


def test_client_auth_without_a_ca_is_refused_at_start(certs):
    with pytest.raises(ValueError, match="metrics_client_cafile"):
        TLS(
            certfile=str(certs / "server.pem"),
            keyfile=str(certs / "server.key"),
            client_auth_required=True,
        ).context()


def test_watch_serves_https_from_the_config_and_names_a_bad_certificate_file(certs, tmp_path):
    import torch

    import torchvitals

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tls = dict(
        metrics_certfile=str(certs / "server.pem"),
        metrics_keyfile=str(certs / "server.key"),
        metrics_client_cafile=str(certs / "ca.pem"),
        metrics_client_auth_required=True,
    )
    with torchvitals.watch(model, opt, metrics_port=free_ports(1), log_dir="", **tls) as agent:
        model(torch.randn(2, 4)).sum().backward()
        agent.step(1.0)
        assert "torchvitals_step" in scrape(agent.metrics_url, client(certs, "client"))
    with pytest.raises(ValueError, match="metrics_certfile"):
        torchvitals.watch(
            model,
            opt,
            metrics_port=free_ports(1),
            log_dir="",
            **dict(tls, metrics_certfile=str(tmp_path / "missing.pem")),
        )
    assert "step" not in vars(opt), "the failed watch() left the guard installed"
