"""/metrics stays up whatever clients do: a seeded random mix of well-behaved and hostile clients
against a real plain and a real TLS MetricsServer, scraped all along.

    python -m pytest tests/integration/test_metrics_server_fuzz.py -q
    TORCHVITALS_FUZZ_SEEDS=17 python -m pytest tests/integration/test_metrics_server_fuzz.py -q

The clients (``hostile_clients.py``) run in their own process, as an attacker on the node would,
so this process holds only the servers and the scraper: its threads and file descriptors are the
servers' own. For each seed, during the attack and after it, every real scrape (urllib, as
Prometheus would) answers 200 with the whole body; the selector threads stay alive and survive no
fault; the threads stay bounded (none per connection); and once the clients are gone the held
connections and file descriptors are back to where they were. A failure names its seed.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from hostile_clients import self_signed

from torchvitals.agent.outputs.render import RenderCache
from torchvitals.agent.outputs.server import WORKERS, MetricsServer
from torchvitals.agent.outputs.tls import TLS

SEEDS = [int(s) for s in os.environ.get("TORCHVITALS_FUZZ_SEEDS", "11,23,42").split(",")]
ATTACK_S = 2.0
IDLE_TIMEOUT_S = 3.0
"""Long enough that a scrape stuck behind a stalled client would time out (``SCRAPE_TIMEOUT_S``)."""
MAX_CONNECTIONS = 8
"""Well below what the attacker holds open (96): the cap drops connections all along."""
SCRAPE_TIMEOUT_S = 2.5
CLIENTS = Path(__file__).with_name("hostile_clients.py")
# A realistic exposition: a few hundred series, ~30 KB.
BODY = "".join(
    f'torchvitals_block_grad_norm{{block="layers.{i}.mlp"}} {i * 0.37:.6f}\n' for i in range(600)
).encode()


def metric_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("torchvitals-metrics")]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def scrape(url: str, context: ssl.SSLContext | None) -> str | None:
    """None when the scrape got the whole body with a 200 within ``SCRAPE_TIMEOUT_S``, else
    what went wrong."""
    began = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S, context=context) as r:
            status, body = r.status, r.read()
    except OSError as exc:
        return f"{url}: {exc!r} after {time.monotonic() - began:.2f} s"
    if status != 200 or body != BODY:
        return f"{url}: HTTP {status}, {len(body)} of {len(BODY)} bytes"
    return None


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    return self_signed(tmp_path_factory.mktemp("fuzz-tls"))


@pytest.mark.parametrize("seed", SEEDS)
def test_every_scrape_is_answered_whatever_the_clients_do(seed, certificate):
    replay = (
        f"seed {seed}; replay: TORCHVITALS_FUZZ_SEEDS={seed} python -m pytest "
        f"tests/integration/test_metrics_server_fuzz.py"
    )
    cert, key = certificate
    context = ssl.create_default_context(cafile=cert)
    fds_before = open_fds()
    cache = RenderCache(lambda accept: (BODY, "text/plain; version=0.0.4"), lambda: 1)
    servers: list[MetricsServer] = []
    attacker = None
    try:
        for tls in (None, TLS(certfile=cert, keyfile=key)):
            servers.append(
                MetricsServer(
                    cache,
                    "127.0.0.1",
                    0,
                    tls=tls,
                    max_connections=MAX_CONNECTIONS,
                    idle_timeout_s=IDLE_TIMEOUT_S,
                )
            )
        plain, secure = servers
        targets = [
            (f"http://127.0.0.1:{plain.port}/metrics", None),
            (f"https://127.0.0.1:{secure.port}/metrics", context),
        ]
        baseline = open_fds()
        attacker = subprocess.Popen(
            [
                sys.executable,
                str(CLIENTS),
                "--plain",
                str(plain.port),
                "--tls",
                str(secure.port),
                "--seed",
                str(seed),
                "--seconds",
                str(ATTACK_S),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        failures: list[str] = []
        scrapes = 0
        most_threads = 0
        deadline = time.monotonic() + ATTACK_S + 30
        while attacker.poll() is None and time.monotonic() < deadline:
            for url, ctx in targets:
                problem = scrape(url, ctx)
                scrapes += 1
                if problem:
                    failures.append(problem)
            most_threads = max(most_threads, len(metric_threads()))
            assert all(s._thread.is_alive() for s in servers), f"a selector thread died; {replay}"
            time.sleep(0.05)
        out, err = attacker.communicate(timeout=30)
        assert attacker.returncode == 0, f"the attacker broke ({replay}): {out} {err[-3000:]}"
        report = json.loads(out.strip().splitlines()[-1])
        assert scrapes >= 10, (scrapes, replay)
        assert not failures, f"{len(failures)} of {scrapes} scrapes failed ({replay}): {failures}"
        # Every kind ran, and the server answered some well-behaved attacker clients as well.
        outcomes = report["outcomes"]
        assert outcomes.get("good 200", 0) > 0, (outcomes, replay)
        assert {k.split()[0] for k in outcomes} >= {
            "half_request",
            "connect_reset",
            "slow_reader",
            "garbage",
            "oversized",
            "idle",
            "send_close",
            "wrong_protocol",
            "half_hello",
        }, (outcomes, replay)
        assert most_threads <= len(servers) * (1 + WORKERS), (most_threads, replay)

        # The clients are gone: nothing stays held, no descriptor leaked, scrapes still answer.
        end = time.monotonic() + IDLE_TIMEOUT_S + 5
        while time.monotonic() < end and (
            any(s._waiting or s._busy for s in servers) or open_fds() != baseline
        ):
            time.sleep(0.05)
        held = [(len(s._waiting), s._busy) for s in servers]
        assert held == [(0, 0), (0, 0)], (held, replay)
        assert open_fds() == baseline, (open_fds(), baseline, replay)
        for url, ctx in targets:
            assert scrape(url, ctx) is None, replay
        assert [s.loop_faults for s in servers] == [0, 0], replay
        assert all(s._thread.is_alive() for s in servers), replay
        assert len(metric_threads()) <= len(servers) * (1 + WORKERS), replay
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.communicate()
        for s in servers:
            s.close()
    assert not metric_threads(), replay
    assert open_fds() == fds_before, replay
