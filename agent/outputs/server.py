"""A bounded HTTP server for one rank's /metrics: fit for a shared node.

    server = MetricsServer(RenderCache(render, version), host="127.0.0.1", port=19400)
    curl -s http://127.0.0.1:19400/metrics                # served until server.close()

prometheus-client's own server starts a thread per connection and never times one out: 200
idle connections held 135 threads for as long as they stayed open, and a tight scrape loop on
the same two cores made the training step 3.5x slower. Here one selector thread accepts
connections and reads each one's request head without blocking (with TLS, the handshake too), so
a connection that is idle, sends half a request or stalls mid-handshake costs a file descriptor
and no thread. Only a complete request reaches the fixed pool of worker threads; a worker
answers with a send buffer the size of the answer (up to the kernel's limit), so a client that
never reads holds no worker either. A connection without a complete request within
``idle_timeout_s`` is closed, and beyond ``max_connections`` the oldest waiting one is dropped,
so a real scraper always gets in. The exposition text is rendered again only after a new step
(the exporter's version) or, for the host vitals read at render time, after
``min_render_interval_s`` (``render.py``; the TLS settings are ``tls.py``).

That still let a scrape loop slow the step: each answer parses a request, and with a step every
few milliseconds renders the text again, on the training process's GIL (a 6.8 ms step ran 2.44x
slower under two clients scraping 300 times a second). With a ``budget`` (``ratelimit.py``), a
client address beyond its scrapes a second gets ``429 Too Many Requests`` with ``Retry-After``
from the selector thread as soon as its request head is complete: nothing of the request is
parsed, nothing rendered, no worker woken. Prometheus, scraping every 10-60 s, never meets it.
The selector thread also reads a request right after accepting its connection (it is usually
there already), not one turn of the loop later.

Whatever clients do, the selector thread keeps serving. In one ``select()`` batch it reads the
connections first and accepts last, so the cap never closes a socket the batch still reports
(that once crashed the thread) and a connection whose request arrived is answered, not
dropped for a newcomer; an event for a connection no longer waiting is skipped. A client that
resets before or during accept is forgotten without a word. Out of file descriptors (EMFILE),
the listener stays readable: it is left alone for a back-off of 5 ms doubling to 1 s instead of
being retried in a spin. An error nobody foresaw is logged once and the loop goes on
(``loop_faults`` counts them).

TLS (``tls``): the handshake is non-blocking on the selector thread (OpenSSL releases the GIL
while it computes) and bounded by the idle timeout; with client-certificate authentication a
scraper without a certificate the CA signed is refused at the handshake.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import math
import re
import selectors
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler

from .ratelimit import ScrapeBudget
from .render import RenderCache
from .tls import TLS

log = logging.getLogger(__name__)

WORKERS = 2
MAX_CONNECTIONS = 32
IDLE_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 16384
"""A request head longer than this is dropped unanswered: Prometheus sends a few hundred bytes."""
ACCEPT_BACKOFF_S = (0.005, 1.0)
"""After an accept error that is not one client's (EMFILE, ENFILE, ENOBUFS...), the listener is
left alone this long, doubling from the first to the second (Go's net/http Server.Serve)."""

_HEAD_END = re.compile(rb"\n\r?\n")  # http.server takes bare LF line ends too
_CLIENT_GONE = frozenset(
    {
        errno.ECONNABORTED,
        errno.ECONNRESET,
        errno.EPERM,
        # accept(2) on Linux: "already-pending network errors on the new socket" come back as
        # accept's error; "treat them like EAGAIN by retrying".
        errno.ENETDOWN,
        errno.EPROTO,
        errno.ENOPROTOOPT,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.EOPNOTSUPP,
        errno.ENETUNREACH,
        *([errno.ENONET] if hasattr(errno, "ENONET") else []),
    }
)
"""accept() errors that cost one pending connection, not the listener: nothing to report."""


_TOO_MANY = (
    "HTTP/1.0 429 Too Many Requests\r\nServer: torchvitals\r\nRetry-After: {retry}\r\n"
    "Content-Type: text/plain; charset=utf-8\r\nContent-Length: {length}\r\n"
    "Connection: close\r\n\r\n{body}"
)
_TOO_MANY_BODY = (
    "torchvitals /metrics: more than {rate:g} scrapes a second (burst {burst}) from this "
    "address; retry after {retry} s (metrics_scrapes_per_s, metrics_scrape_burst)\n"
)


def _too_many(budget: ScrapeBudget, wait_s: float) -> bytes:
    """The whole 429 answer: Retry-After in whole seconds, rounded up (RFC 9110)."""
    retry = max(1, math.ceil(wait_s))
    body = _TOO_MANY_BODY.format(
        rate=budget.limit.scrapes_per_s, burst=budget.limit.burst, retry=retry
    )
    return _TOO_MANY.format(retry=retry, length=len(body), body=body).encode()


class _Handler(BaseHTTPRequestHandler):
    """One request per connection (HTTP/1.0): GET or HEAD of /metrics (or /), its head already
    read by the selector thread."""

    server_version = "torchvitals"
    cache: RenderCache

    def __init__(self, conn: socket.socket, head: bytes, peer: tuple, server: object) -> None:
        self._head = head
        super().__init__(conn, peer, server)  # type: ignore[arg-type]  # handles the request

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = io.BytesIO(self._head)  # nothing left to read from the socket: no stall

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        data, content_type = self.cache.get(self.headers.get("Accept", ""))
        # A client that never reads must not hold a worker for the idle timeout: a send buffer
        # the size of the answer (plus headers and TLS framing) lets the kernel take it at once.
        # Linux caps it at twice net.core.wmem_max (2 x 208 KiB by default); a larger answer to
        # such a client still holds the worker, for the idle timeout at most.
        need = len(data) + 16384
        if body and self.connection.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < need:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, need)
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a scrape every few seconds is not news


@dataclasses.dataclass(eq=False)
class _Waiting:
    """A connection the selector thread holds until its request head is complete."""

    since: float
    """When it was accepted: the idle timeout counts from here, however slowly bytes arrive."""
    peer: tuple
    tls_handshake: bool
    """The TLS handshake is still to finish."""
    head: bytearray = dataclasses.field(default_factory=bytearray)
    events: int = selectors.EVENT_READ
    """What the selector waits for: a TLS handshake may need to write first."""


class MetricsServer:
    """Serves ``cache`` on ``host:port`` until ``close()``.

    Args:
        cache: the rendered exposition.
        host, port: the address to bind (port 0: any free port, see ``.port``).
        tls: serve HTTPS with this configuration.
        workers: threads that answer requests.
        max_connections: connections held open at once (the oldest waiting one goes first).
        idle_timeout_s: a connection that sends no complete request within this is closed; it
            also bounds writing one answer.
        selector: what the selector thread waits on (default: the platform's best; tests pass
            one they can hold to line events up).
        budget: each client address's scrapes a second; beyond it a request is answered 429
            before it is parsed (None: no limit). Used by the selector thread alone.

    Raises:
        OSError: the address cannot be bound.
    """

    loop_faults: int
    """Unexpected errors the selector thread survived (each logged the first time): zero unless
    this module has a bug."""

    refused: int
    """Requests answered 429 because their address had spent its ``budget``."""

    def __init__(
        self,
        cache: RenderCache,
        host: str,
        port: int,
        *,
        tls: TLS | None = None,
        workers: int = WORKERS,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        selector: selectors.BaseSelector | None = None,
        budget: ScrapeBudget | None = None,
    ) -> None:
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self.budget = budget
        self._ssl = tls.context() if tls is not None else None
        self._handler = type("Handler", (_Handler,), {"cache": cache, "timeout": idle_timeout_s})
        # Owned by the selector thread alone: in accept order, so the first is the oldest.
        self._waiting: dict[socket.socket, _Waiting] = {}
        self._accept_delay_s = 0.0  # > 0: accepting failed, paused for this long
        self._resume_accept_at: float | None = None
        self.loop_faults = self.refused = 0
        # Shared with the workers, under the lock.
        self._lock = threading.Lock()
        self._busy = 0
        self._serving: set[socket.socket] = set()
        self._closing = False
        self._stop = threading.Event()
        with contextlib.ExitStack() as built:  # a constructor that fails releases what it built
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = built.enter_context(
                socket.create_server((host, port), family=family, backlog=64)
            )
            self._listener.setblocking(False)
            self.port = self._listener.getsockname()[1]
            self._selector = built.enter_context(selector or selectors.DefaultSelector())
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._wake_r, self._wake_w = socket.socketpair()
            built.enter_context(self._wake_r)
            built.enter_context(self._wake_w)
            self._selector.register(self._wake_r, selectors.EVENT_READ)
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="torchvitals-metrics")
            self._thread = threading.Thread(
                target=self._loop, name="torchvitals-metrics-accept", daemon=True
            )
            self._thread.start()
            built.pop_all()

    # -- the selector thread -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._turn()
                except Exception:  # a bug here must cost one turn, not /metrics for the run
                    self.loop_faults += 1
                    if self.loop_faults == 1:
                        log.exception("torchvitals: /metrics selector thread fault; serving on")
                    self._stop.wait(0.1)  # the same fault again must not spin
        finally:
            for sock in list(self._waiting):
                self._drop(sock)
            self._selector.close()
            self._listener.close()

    def _turn(self) -> None:
        accept = False
        for key, _ in self._selector.select(self._timeout()):
            sock = key.fileobj
            if sock is self._listener:
                # After the connections in this batch: one whose request arrived is served,
                # not dropped by the cap for a newcomer.
                accept = True
            elif sock in self._waiting:  # else the wake-up socket, or dropped in this batch
                self._advance(sock)
        if accept:
            self._accept()
        now = time.monotonic()
        self._expire(now - self.idle_timeout_s)
        if self._resume_accept_at is not None and now >= self._resume_accept_at:
            self._resume_accept_at = None
            self._selector.register(self._listener, selectors.EVENT_READ)

    def _timeout(self) -> float | None:
        """Until the oldest waiting connection expires or accepting resumes; no deadline: until
        an event (close() writes to the wake-up socket)."""
        deadlines = [] if self._resume_accept_at is None else [self._resume_accept_at]
        if self._waiting:
            deadlines.append(next(iter(self._waiting.values())).since + self.idle_timeout_s)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _accept(self) -> None:
        try:
            conn, peer = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno not in _CLIENT_GONE:
                self._pause_accepting(exc)
            return
        if self._accept_delay_s:
            log.info("torchvitals: /metrics accepts connections again")
            self._accept_delay_s = 0.0
        try:
            conn.getpeername()
            conn.setblocking(False)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        except OSError:  # reset already (ENOTCONN; or ECONNRESET inside ssl's own check)
            conn.close()
            return
        with self._lock:
            held = len(self._waiting) + self._busy
        if held >= self.max_connections:
            if not self._waiting:
                conn.close()  # every slot busy answering: the client retries next scrape
                return
            self._drop(next(iter(self._waiting)))
        self._waiting[conn] = _Waiting(time.monotonic(), peer, tls_handshake=self._ssl is not None)
        self._selector.register(conn, selectors.EVENT_READ)
        # A client sends its request right after connecting: by now it is usually here, and
        # reading it at once spares a turn of the loop (and its GIL hand-offs) per scrape.
        self._advance(conn)

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of file descriptors (say): the pending connection stays queued and the listener
        readable, so retrying at once would spin. Go's net/http backs off the same way."""
        if not self._accept_delay_s:
            log.warning(
                "torchvitals: /metrics cannot accept connections (%s); retrying with a "
                "back-off of up to %.0f s; connections already accepted are served",
                exc,
                ACCEPT_BACKOFF_S[1],
            )
        self._accept_delay_s = min(
            ACCEPT_BACKOFF_S[1], max(ACCEPT_BACKOFF_S[0], 2 * self._accept_delay_s)
        )
        self._resume_accept_at = time.monotonic() + self._accept_delay_s
        self._selector.unregister(self._listener)

    def _advance(self, sock: socket.socket) -> None:
        """Take a waiting connection as far as its bytes allow: the TLS handshake, then the
        request head; complete, it goes to a worker."""
        waiting = self._waiting[sock]
        try:
            if waiting.tls_handshake:
                sock.do_handshake()  # type: ignore[attr-defined]  # an ssl.SSLSocket
                waiting.tls_handshake = False
            while len(waiting.head) <= MAX_HEAD_BYTES:
                chunk = sock.recv(4096)
                if not chunk:
                    break  # closed before the request ended
                start = max(0, len(waiting.head) - 2)
                waiting.head += chunk
                if _HEAD_END.search(waiting.head, start):
                    wait_s = 0.0 if self.budget is None else self.budget.take(waiting.peer[0])
                    if wait_s:
                        self._refuse(sock, wait_s)
                    else:
                        self._hand_off(sock, waiting)
                    return
        except ssl.SSLWantWriteError:
            self._wait_for(sock, waiting, selectors.EVENT_WRITE)
            return
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            self._wait_for(sock, waiting, selectors.EVENT_READ)
            return
        except OSError:  # reset, or a failed TLS handshake (an ssl.SSLError)
            pass
        self._drop(sock)

    def _wait_for(self, sock: socket.socket, waiting: _Waiting, events: int) -> None:
        if waiting.events != events:
            self._selector.modify(sock, events)
            waiting.events = events

    def _hand_off(self, sock: socket.socket, waiting: _Waiting) -> None:
        self._selector.unregister(sock)
        del self._waiting[sock]
        with self._lock:
            self._busy += 1
            self._serving.add(sock)
        self._pool.submit(self._serve, sock, bytes(waiting.head), waiting.peer)

    def _refuse(self, sock: socket.socket, wait_s: float) -> None:
        """Answer 429 here, on the selector thread: the answer fits any empty send buffer, and
        this costs the training thread less than waking a worker would."""
        assert self.budget is not None
        self.refused += 1
        answer = _too_many(self.budget, wait_s)
        self._waiting.pop(sock)
        self._selector.unregister(sock)
        with contextlib.suppress(OSError):  # gone already, or TLS wants to read: closed unanswered
            sock.send(answer)
        sock.close()

    def _expire(self, before: float) -> None:
        while self._waiting:
            sock, waiting = next(iter(self._waiting.items()))
            if waiting.since >= before:
                return  # accept order: every later one is younger
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        """Close a waiting connection (one already forgotten is left alone). A socket closed
        behind our back is still found: the selector looks a closed one up by identity."""
        if self._waiting.pop(sock, None) is None:
            return
        self._selector.unregister(sock)
        sock.close()

    # -- the workers ---------------------------------------------------------------------------

    def _serve(self, conn: socket.socket, head: bytes, peer: tuple) -> None:
        try:
            if not self._stop.is_set():  # closing: a queued request is closed, not answered
                self._handler(conn, head, peer, self)
        except OSError:
            pass  # a client that left or stopped reading mid-answer
        finally:
            with self._lock:  # close() shuts sockets down under it: never a reused fd
                self._serving.discard(conn)
                self._busy -= 1
                conn.close()

    def close(self) -> None:
        """Stop accepting, close every connection, wait for the threads; safe to call twice,
        from any thread."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            log.warning("torchvitals: /metrics selector thread did not stop within 5 s")
        with self._lock:
            for conn in self._serving:
                # Wakes a worker blocked writing to a client that does not read. The plain
                # socket's shutdown: SSLSocket's would drop its SSL object under that worker.
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(conn, socket.SHUT_RDWR)
        self._pool.shutdown(wait=True)
        self._wake_r.close()
        self._wake_w.close()
