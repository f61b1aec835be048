"""A bounded HTTP server for one rank's /metrics: fit for a shared node.

    server = MetricsServer(render, host="127.0.0.1", port=9400)   # serving until close()
    curl -s http://127.0.0.1:9400/metrics

prometheus-client's own server starts a thread per connection and never times one out: 200
idle connections held 135 threads for as long as they stayed open, and a tight scrape loop on
the same two cores made the training step 3.5x slower. Here one selector thread waits for
connections to send their request (an idle connection costs a file descriptor, no thread), a
fixed pool of worker threads answers, a connection idle for ``idle_timeout_s`` is closed, and
beyond ``max_connections`` the oldest idle one is dropped, so a real scraper always gets in. The
exposition text is rendered again only after a new step (the exporter's version) or, for the
host vitals read at render time, after ``min_render_interval_s``, so a scrape loop costs the
training thread no more than a cached read, however fast it scrapes.

TLS (``ssl_context``): the handshake runs on a worker, with the idle timeout, never on the
accept loop; with client-certificate authentication a scraper without a certificate the CA
signed is refused at the handshake.
"""

from __future__ import annotations

import dataclasses
import logging
import selectors
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from typing import Callable

log = logging.getLogger(__name__)

WORKERS = 2
MAX_CONNECTIONS = 32
IDLE_TIMEOUT_S = 10.0
MIN_RENDER_INTERVAL_S = 1.0


@dataclasses.dataclass(frozen=True)
class TLS:
    """TLS for /metrics, as prometheus-client's own server takes it.

    Args:
        certfile, keyfile: the server's certificate chain and key (PEM).
        client_cafile: a CA bundle; with it, clients may present a certificate it signed.
        client_auth_required: refuse clients without such a certificate (mutual TLS).
    """

    certfile: str
    keyfile: str | None = None
    client_cafile: str | None = None
    client_auth_required: bool = False

    def context(self) -> ssl.SSLContext:
        """The server's SSL context.

        Raises:
            ValueError: a file cannot be read or is not what its setting says, naming both.
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"metrics_certfile {self.certfile!r} / metrics_keyfile "
                             f"{self.keyfile!r}: not a readable PEM certificate chain and its "
                             f"key ({exc})") from None
        if self.client_cafile:
            try:
                ctx.load_verify_locations(cafile=self.client_cafile)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"metrics_client_cafile {self.client_cafile!r}: not a readable "
                                 f"PEM CA bundle ({exc})") from None
            ctx.verify_mode = ssl.CERT_REQUIRED if self.client_auth_required else ssl.CERT_OPTIONAL
        elif self.client_auth_required:
            raise ValueError("metrics_client_auth_required needs metrics_client_cafile: the CA "
                             "whose client certificates are accepted")
        return ctx


class RenderCache:
    """The exposition bytes per content type, rendered again when the exporter's version changed
    (a new step) or ``min_interval_s`` passed (host vitals are read at render time)."""

    def __init__(self, render: Callable[[str], tuple[bytes, str]], version: Callable[[], int],
                 min_interval_s: float = MIN_RENDER_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._render, self._version, self._clock = render, version, clock
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[int, float, bytes, str]] = {}
        self.renders = 0
        """How many times the text was rendered (tests: bounded by steps, not scrapes)."""

    def get(self, accept: str) -> tuple[bytes, str]:
        with self._lock:
            version, now = self._version(), self._clock()
            hit = self._cache.get(accept)
            if hit is not None and hit[0] == version and now - hit[1] < self.min_interval_s:
                return hit[2], hit[3]
            body, content_type = self._render(accept)
            self.renders += 1
            self._cache[accept] = (version, now, body, content_type)
            if len(self._cache) > 8:        # a client cycling Accept headers stays bounded
                self._cache.pop(next(iter(self._cache)))
            return body, content_type


class _Handler(BaseHTTPRequestHandler):
    """One request per connection (HTTP/1.0): GET or HEAD of /metrics (or /)."""

    server_version = "torchvitals"
    cache: RenderCache

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        data, content_type = self.cache.get(self.headers.get("Accept", ""))
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass          # a scrape every few seconds is not news


class MetricsServer:
    """Serves ``cache`` on ``host:port`` until ``close()``.

    Args:
        cache: the rendered exposition.
        host, port: the address to bind (port 0: any free port, see ``.port``).
        tls: serve HTTPS with this configuration.
        workers: threads that answer requests.
        max_connections: connections held open at once (the oldest idle one goes first).
        idle_timeout_s: a connection that sends no complete request within this is closed.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, cache: RenderCache, host: str, port: int, *, tls: TLS | None = None,
                 workers: int = WORKERS, max_connections: int = MAX_CONNECTIONS,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self._ssl = tls.context() if tls is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._handler = type("Handler", (_Handler,), {"cache": cache, "timeout": idle_timeout_s})
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="torchvitals-metrics")
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._waiting: dict[socket.socket, float] = {}   # accepted, no request yet -> since
        self._busy = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="torchvitals-metrics-accept",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=min(1.0, self.idle_timeout_s)):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                elif sock is self._wake_r:
                    continue
                else:
                    self._selector.unregister(sock)
                    del self._waiting[sock]
                    with self._lock:
                        self._busy += 1
                    self._pool.submit(self._serve, sock)
            self._expire(time.monotonic() - self.idle_timeout_s)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:          # out of file descriptors, say: keep serving the rest
            log.warning("torchvitals: /metrics accept failed: %s", exc)
            return
        with self._lock:
            held = len(self._waiting) + self._busy
        if held >= self.max_connections and self._waiting:
            oldest = min(self._waiting, key=self._waiting.get)
            self._drop(oldest)
        elif held >= self.max_connections:
            conn.close()            # every slot busy answering: the client retries next scrape
            return
        conn.setblocking(False)
        self._waiting[conn] = time.monotonic()
        self._selector.register(conn, selectors.EVENT_READ)

    def _expire(self, before: float) -> None:
        for sock in [s for s, since in self._waiting.items() if since < before]:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._waiting[sock]
        sock.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(self.idle_timeout_s)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True)
            self._handler(conn, conn.getpeername(), self)
        except (OSError, ssl.SSLError):
            pass                    # a client that left, timed out or failed the handshake
        finally:
            conn.close()
            with self._lock:
                self._busy -= 1

    def close(self) -> None:
        """Stop accepting, close every connection, wait for the threads; safe to call twice."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)
        for sock in list(self._waiting):
            self._drop(sock)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
