"""/metrics against a scrape loop: the loop's address gets 429 with Retry-After, never a render;
a scraper at Prometheus' pace always gets 200 with the full metrics.

    python -m pytest tests/integration/test_metrics_server_limit.py -q

Real servers on free loopback ports. The loops scrape from 127.0.0.2 (loopback too on Linux), the
scraper from 127.0.0.1: each address has a budget of its own. Where Prometheus' pace matters (15 s
between scrapes), the budget reads a fake clock instead of waiting.
"""

from __future__ import annotations

import http.client
import itertools
import os
import ssl
import threading
import time
from collections import Counter

import pytest
from hostile_clients import self_signed
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.world import free_port

import torchvitals
from torchvitals.agent.outputs.exporter import Exporter
from torchvitals.agent.outputs.ratelimit import ScrapeBudget, ScrapeLimit
from torchvitals.agent.outputs.render import RenderCache
from torchvitals.agent.outputs.server import WORKERS, MetricsServer
from torchvitals.agent.outputs.tls import TLS
from torchvitals.agent.report import Report

LOOP, SCRAPER = "127.0.0.2", "127.0.0.1"
BODY = "".join(f'torchvitals_grad_norm{{block="b{i}"}} {i}.5\n' for i in range(300)).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def get(
    port: int, source: str, context: ssl.SSLContext | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    """One request for /metrics on a new connection from ``source``: status, headers, body."""
    args = dict(timeout=10, source_address=(source, 0))
    conn = (
        http.client.HTTPSConnection("127.0.0.1", port, context=context, **args)
        if context
        else http.client.HTTPConnection("127.0.0.1", port, **args)
    )
    try:
        conn.request(method, "/metrics", headers={"Accept": "text/plain"})
        answer = conn.getresponse()
        return answer.status, dict(answer.getheaders()), answer.read()
    finally:
        conn.close()


def metric_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("torchvitals-metrics")]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def report(step: int) -> Report:
    return Report(step=step, loss=1.0 / step, grad_norm={"a": 1.0}, grad_norm_total=1.0)


def families(body: bytes) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(body.decode())}


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    return self_signed(tmp_path_factory.mktemp("limit-tls"))


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_scrape_loop_gets_429_with_retry_after_and_never_a_render(scheme, certificate):
    cert, key = certificate
    tls = TLS(certfile=cert, keyfile=key) if scheme == "https" else None
    context = ssl.create_default_context(cafile=cert) if tls else None
    renders: list[str] = []

    def render(accept: str) -> tuple[bytes, str]:
        renders.append(accept)
        return BODY, "text/plain; version=0.0.4"

    steps = itertools.count()  # a new step before every request: each answered one renders
    clock = Clock()
    budget = ScrapeBudget(ScrapeLimit(scrapes_per_s=0.5, burst=3), clock=clock)
    server = MetricsServer(
        RenderCache(render, lambda: next(steps)), "127.0.0.1", 0, tls=tls, budget=budget
    )
    try:
        answers = [get(server.port, LOOP, context) for _ in range(40)]
        assert [a[0] for a in answers] == [200] * 3 + [429] * 37
        assert all(body == BODY for _, _, body in answers[:3])
        for _, headers, body in answers[3:]:
            # No token, 0.5 a second: the next one in 2 s.
            assert headers["Retry-After"] == "2", headers
            assert b"metrics_scrapes_per_s" in body and b"retry after 2 s" in body
            assert int(headers["Content-Length"]) == len(body)
        assert len(renders) == 3, "a refused scrape was rendered"
        assert server.refused == 37
        # Refused before it is parsed: a method nobody serves gets the same 429 ...
        status, headers, _ = get(server.port, LOOP, context, method="BREW")
        assert status == 429 and headers["Retry-After"] == "2"
        # ... where an address with tokens left has it parsed, and refused as unsupported.
        assert get(server.port, SCRAPER, context, method="BREW")[0] == 501
        # Retry-After says when: then the loop is served once, and refused again.
        clock.now += 2.0
        assert [get(server.port, LOOP, context)[0] for _ in range(2)] == [200, 429]
        assert len(renders) == 4
        assert server.loop_faults == 0 and not server._waiting
    finally:
        server.close()


def test_a_scraper_at_prometheus_pace_always_gets_the_full_metrics_during_a_flood():
    clock = Clock()
    ex = Exporter(["a"], rank=0, local_rank=0, world_size=1, port=0)  # serves nothing itself
    limit = ScrapeLimit()  # the settings' defaults
    server = MetricsServer(ex.cache, "127.0.0.1", 0, budget=ScrapeBudget(limit, clock=clock))
    counts: list[Counter[int]] = [Counter() for _ in range(2)]
    stop = threading.Event()

    def flood(got: Counter[int]) -> None:
        while not stop.is_set():
            got[get(server.port, LOOP)[0]] += 1

    loops = [threading.Thread(target=flood, args=(got,)) for got in counts]
    try:
        for t in loops:
            t.start()
        for step in range(1, 21):
            ex.update(report(step))
            clock.now += 15.0  # Prometheus' default scrape interval
            status, _, body = get(server.port, SCRAPER)
            assert status == 200, (step, body[:200])
            got = families(body)
            assert got["torchvitals_step"][0].value == step
            # The full metrics: every family the registry holds, each with all its samples.
            reference = families(generate_latest(ex.registry))
            assert {n: len(s) for n, s in got.items()} == {n: len(s) for n, s in reference.items()}
            time.sleep(0.02)  # the loops get their turns in between
    finally:
        stop.set()
        for t in loops:
            t.join(15)
        server.close()
        ex.close()
    flooded: Counter[int] = sum(counts, Counter())
    assert flooded[429] > flooded[200], flooded
    # The loop's own bucket refills at each 15 s jump of the clock: the burst, 20 times over.
    assert flooded[200] <= limit.burst * 21, flooded
    assert set(flooded) <= {200, 429}, flooded


def test_the_settings_reach_the_rank_and_refusals_are_counted_for_prometheus():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # One token a 100 s: nothing refills within the test, however slow the machine.
    limit = dict(metrics_scrapes_per_s=0.01, metrics_scrape_burst=2)
    with torchvitals.watch(model, opt, metrics_port=free_port(), log_dir="", **limit) as agent:
        model(torch.randn(2, 4)).sum().backward()
        agent.step(1.0)
        port = agent.outputs.exporter.port
        answers = [get(port, LOOP) for _ in range(4)]
        assert [a[0] for a in answers] == [200, 200, 429, 429]
        assert all(1 <= int(a[1]["Retry-After"]) <= 100 for a in answers[2:])
        model(torch.randn(2, 4)).sum().backward()
        agent.step(1.0)  # the text is rendered again after a step: the count is read then
        status, _, body = get(port, SCRAPER)
        assert status == 200
        refused = families(body)["torchvitals_metrics_scrapes_refused"]
        assert [(s.name, s.labels, s.value) for s in refused] == [
            ("torchvitals_metrics_scrapes_refused_total", {"rank": "0"}, 2.0)
        ]
    with torchvitals.watch(
        model, opt, metrics_port=free_port(), log_dir="", metrics_scrapes_per_s=0
    ) as agent:
        port = agent.outputs.exporter.port
        assert [get(port, LOOP)[0] for _ in range(12)] == [200] * 12, "the limit is off"


def test_a_flood_holds_no_threads_leaks_no_descriptors_and_renders_at_the_budget():
    ex = Exporter(["a"], rank=0, local_rank=0, world_size=1, port=free_port())
    limit = ScrapeLimit()
    counts: list[Counter[int]] = [Counter() for _ in range(4)]
    stop = threading.Event()

    def flood(got: Counter[int]) -> None:
        while not stop.is_set():
            got[get(ex.port, LOOP)[0]] += 1

    loops = [threading.Thread(target=flood, args=(got,)) for got in counts]
    try:
        ex.update(report(1))
        baseline, renders = open_fds(), ex.cache.renders
        began = time.monotonic()
        for t in loops:
            t.start()
        most_threads = 0
        for step in range(2, 100):  # a new step every 10 ms: each answered scrape renders
            ex.update(report(step))
            most_threads = max(most_threads, len(metric_threads()))
            time.sleep(0.01)
        stop.set()
        for t in loops:
            t.join(15)
        elapsed = time.monotonic() - began
        answers: Counter[int] = sum(counts, Counter())
        server = ex._server
        end = time.monotonic() + 10
        while server._waiting or server._busy or open_fds() != baseline:
            if time.monotonic() > end:
                break  # the asserts below say what is still held
            time.sleep(0.02)
        assert most_threads <= 1 + WORKERS, most_threads
        assert (len(server._waiting), server._busy) == (0, 0)
        assert open_fds() == baseline
        assert answers[429] > 0 and set(answers) <= {200, 429}, answers
        assert server.refused == answers[429]
        # Renders are bounded by the budget, not by the scrapes: the burst, then its rate.
        bound = limit.burst + int(limit.scrapes_per_s * elapsed) + 1
        assert answers[200] <= bound, (answers, elapsed)
        assert ex.cache.renders - renders <= answers[200]
        assert server.loop_faults == 0 and server._thread.is_alive()
        assert get(ex.port, SCRAPER)[0] == 200
    finally:
        stop.set()
        ex.close()
    assert not metric_threads()
