"""/metrics against clients that break the rules, one case at a time, lined up deterministically.

    python -m pytest tests/integration/test_metrics_server_faults.py -q

A real MetricsServer on a free loopback port. Where the case is an ordering inside the selector
thread, the test holds that thread (``HeldSelector``) while its clients act, then lets it see
everything in one ``select()`` batch; out of file descriptors is a child process with a low
RLIMIT_NOFILE. Each test ends the same way: the selector thread is alive and survived no fault,
and a real scrape answers.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest
from hostile_clients import REQUEST, client_hello, connect, reset, self_signed

from torchvitals.agent.outputs.render import RenderCache
from torchvitals.agent.outputs.server import MetricsServer
from torchvitals.agent.outputs.tls import TLS

BODY = b"torchvitals_step 1\n"


class HeldSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The platform's selector, which a test can hold: ``hold()`` returns once the selector
    thread is parked before its next ``select()``; ``release(n)`` lets it go, and that select
    returns once ``n`` objects are ready, all in one batch, the listener first (the order in
    which the cap used to close a socket the same batch still reported)."""

    def __init__(self) -> None:
        super().__init__()
        self._hold, self._parked, self._go = threading.Event(), threading.Event(), threading.Event()
        self._want = 0

    def hold(self) -> None:
        self._parked.clear()
        self._go.clear()
        self._hold.set()
        assert self._parked.wait(5), "the selector thread never came back to select()"

    def release(self, ready: int) -> None:
        self._want = ready
        self._hold.clear()
        self._go.set()

    def select(self, timeout=None):
        end = time.monotonic() + (timeout if timeout is not None else 3600.0)
        while True:
            if self._hold.is_set():
                self._parked.set()
                assert self._go.wait(10), "held for 10 s: release() never came"
                return self._batch()
            # Short slices: a hold() takes effect between them, never inside a real select.
            events = super().select(min(0.005, max(0.0, end - time.monotonic())))
            if events or time.monotonic() >= end:
                return events

    def _batch(self):
        end = time.monotonic() + 5
        events = super().select(0)
        while len(events) < self._want and time.monotonic() < end:
            time.sleep(0.001)
            events = super().select(0)
        assert len(events) >= self._want, f"only {len(events)} ready of {self._want}"
        return sorted(events, key=lambda e: not _listening(e[0].fileobj))


def _listening(sock) -> bool:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1


@contextmanager
def serve(body: bytes = BODY, **kwargs) -> Iterator[MetricsServer]:
    server = MetricsServer(
        RenderCache(lambda accept: (body, "text/plain"), lambda: 1), "127.0.0.1", 0, **kwargs
    )
    try:
        yield server
    finally:
        server.close()


def scrape(server: MetricsServer, timeout: float = 5.0, context=None) -> bytes:
    scheme = "https" if context is not None else "http"
    url = f"{scheme}://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
        assert r.status == 200
        return r.read()


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def wait_until(check, timeout: float = 5.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.01)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def healthy(server: MetricsServer, context=None) -> None:
    assert server._thread.is_alive(), "the selector thread died"
    assert server.loop_faults == 0, "the selector thread survived a fault: a bug"
    assert scrape(server, context=context) == BODY


def test_a_connection_the_cap_drops_is_not_touched_again_later_in_the_same_batch():
    # Once the cap closed the oldest waiting connection while the same select() batch
    # still reported it ready; unregistering it raised ValueError (fd -1) and /metrics was dead.
    held = HeldSelector()
    with serve(max_connections=2, selector=held) as server:
        a, b = connect(server.port), connect(server.port)
        wait_until(lambda: len(server._waiting) == 2, what="both connections accepted")
        held.hold()
        c = connect(server.port)
        a.sendall(REQUEST)
        held.release(ready=2)  # the listener (for c), then a's request
        try:
            answer = read_all(a)
        except OSError as exc:
            answer = repr(exc).encode()
        server._thread.join(0.05)  # a crash follows the drop at once: give it the time
        assert server._thread.is_alive(), "the selector thread died"
        assert server.loop_faults == 0
        # a had sent its request: it is answered, the cap drops an idle one for c.
        assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(BODY), answer[:200]
        healthy(server)
        for s in (a, b, c):
            s.close()


def test_clients_that_reset_before_accept_or_mid_request_are_forgotten_quietly(caplog):
    held = HeldSelector()
    with serve(selector=held) as server:
        held.hold()
        for sent in (b"", b"GET /met", REQUEST):
            sock = connect(server.port)
            if sent:
                sock.sendall(sent)
            reset(sock)
        held.release(ready=1)
        wait_until(lambda: not server._waiting and not server._busy, what="all forgotten")
        healthy(server)
    assert not [r for r in caplog.records if r.name.endswith("outputs.server")], caplog.text


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[TLS, ssl.SSLContext]:
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    return TLS(certfile=cert, keyfile=key), ssl.create_default_context(cafile=cert)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_clients_that_stall_hold_no_worker(scheme, tls):
    """With one worker: a client stalled mid-request, mid-handshake or not reading a 300 KB
    answer used to hold it for the idle timeout, and every scrape waited behind it."""
    config, context = tls if scheme == "https" else (None, None)
    answer = b"x" * 300_000

    def opened(**kw) -> socket.socket:
        sock = connect(server.port, **kw)
        return context.wrap_socket(sock, server_hostname="127.0.0.1") if context else sock

    with serve(body=answer, workers=1, idle_timeout_s=5.0, tls=config) as server:
        half = opened()
        half.sendall(REQUEST[:20])
        reader = opened(rcvbuf=4096)  # a small window: the answer cannot reach it
        reader.sendall(REQUEST)
        stalled = [half, reader]
        if context:
            hello = connect(server.port)
            hello.sendall(client_hello()[:50])
            stalled.append(hello)
            with connect(server.port) as plain:  # plain HTTP on the TLS port: refused
                plain.sendall(REQUEST)
                with suppress(ConnectionResetError):
                    assert not plain.recv(100).startswith(b"HTTP")
        wait_until(lambda: server._busy == 0, what="the slow reader's answer handed over")
        began = time.monotonic()
        assert scrape(server, timeout=4.0, context=context) == answer
        assert time.monotonic() - began < 2.0, "the scrape waited behind a stalled client"
        assert server.loop_faults == 0
        for s in stalled:
            s.close()


def test_a_saturated_worker_pool_refuses_newcomers_and_recovers():
    # Answers beyond any socket buffer (net.core.wmem_max) to clients that never read: both
    # slots are busy answering, so a newcomer is closed at once, not queued for the timeout.
    answer = b"x" * (32 << 20)
    with serve(body=answer, workers=1, max_connections=2, idle_timeout_s=20.0) as server:
        readers = [connect(server.port, rcvbuf=4096) for _ in range(2)]
        for r in readers:
            r.sendall(REQUEST)
        wait_until(lambda: server._busy == 2, what="both readers being answered")
        began = time.monotonic()
        with connect(server.port) as newcomer:
            newcomer.sendall(REQUEST)
            with suppress(ConnectionResetError):
                assert newcomer.recv(100) == b""
        assert time.monotonic() - began < 1.5
        for r in readers:
            reset(r)
        wait_until(lambda: server._busy == 0 and not server._waiting, what="slots free again")
        assert scrape(server, timeout=10.0) == answer
        assert server._thread.is_alive() and server.loop_faults == 0


def test_close_does_not_wait_for_a_client_that_never_reads_and_may_race_itself():
    before = open_fds()
    answer = b"x" * (32 << 20)
    server = MetricsServer(
        RenderCache(lambda accept: (answer, "text/plain"), lambda: 1),
        "127.0.0.1",
        0,
        workers=1,
        idle_timeout_s=30.0,
    )
    reader = connect(server.port, rcvbuf=4096)
    idle = connect(server.port)
    reader.sendall(REQUEST)
    wait_until(lambda: server._busy == 1, what="the reader being answered")
    time.sleep(0.2)  # the worker is blocked in sendall now
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def close() -> None:
        start.wait(5)
        try:
            server.close()
        except BaseException as exc:
            errors.append(exc)

    closers = [threading.Thread(target=close) for _ in range(2)]
    began = time.monotonic()
    for t in closers:
        t.start()
    for t in closers:
        t.join(40)
    took = time.monotonic() - began
    assert not errors, errors
    assert took < 3.0, f"close() took {took:.1f} s: it waited for the worker's write timeout"
    assert not [t for t in threading.enumerate() if t.name.startswith("torchvitals-metrics")]
    reader.close()
    idle.close()
    assert open_fds() == before


EMFILE_CHILD = textwrap.dedent("""
    import json, logging, os, resource, socket, sys, time, urllib.request
    from torchvitals.agent.outputs.render import RenderCache
    from torchvitals.agent.outputs.server import MetricsServer

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    handler.setLevel(logging.WARNING)
    logging.getLogger("torchvitals").addHandler(handler)
    server = MetricsServer(RenderCache(lambda accept: (b"up 1\\n", "text/plain"), lambda: 1),
                           "127.0.0.1", 0, idle_timeout_s=30.0)
    clients = [socket.socket() for _ in range(6)]     # connecting needs no new descriptor
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
    for c in clients:
        c.connect(("127.0.0.1", server.port))
    time.sleep(0.2)                                   # the server ran out of descriptors
    cpu = time.process_time()
    time.sleep(1.0)
    cpu = time.process_time() - cpu
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    began = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
        body = r.read().decode()
    print(json.dumps(dict(cpu_s=cpu, scrape_s=time.monotonic() - began, body=body,
                          warnings=warnings, faults=server.loop_faults)))
    server.close()
""")


def test_out_of_file_descriptors_backs_off_instead_of_spinning():
    # EMFILE leaves the connection queued and the listener readable: retried at once, the
    # selector thread spun at 100% CPU and logged a warning per turn.
    child = subprocess.run(
        [sys.executable, "-c", EMFILE_CHILD], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["cpu_s"] < 0.2, result
    assert len(result["warnings"]) == 1 and "cannot accept" in result["warnings"][0], result
    assert result["body"] == "up 1\n" and result["scrape_s"] < 3.0, result
    assert result["faults"] == 0, result
