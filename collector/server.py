"""The collector's HTTP service: Alertmanager webhook in, directives out, its own /metrics.

    torchvitals-collector            # or: python -m torchvitals.collector --help

Endpoints (every one but /healthz and /metrics needs ``Authorization: Bearer <token>``):

- ``POST /alerts``: an Alertmanager webhook (v4). 401 without the token, 413 when the declared
  or streamed body exceeds ``max_body_bytes`` (refused before it is read), 400 with
  ``{"error": reason, "message": ...}`` when it is not a valid notification, else 200 with the
  count of alerts per outcome and the ids of the directives it issued.
- ``GET /directives?job=J``: ``{"job": J, "directives": [...]}``, J's pending directives.
- ``POST /directives/<id>/ack``: acknowledge once; again returns 200 with ``"acknowledged":
  false``; 404 for an unknown id.
- ``GET /healthz``, ``GET /metrics``.

Starlette on uvicorn (h11): a maintained ASGI stack of two light packages, where the
standard library's ``http.server`` is documented as not meant for production.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .config import CollectorConfig
from .directives import DirectiveStore
from .metrics import CollectorMetrics
from .webhook import PayloadError, parse_notification

log = logging.getLogger("torchvitals.collector")


class _Rejected(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def _authorized(request: Request, token: bytes) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # Constant time over the bytes, so the response time says nothing about a prefix.
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token)


async def _read_capped(request: Request, cap: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``cap`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _Rejected(400, "invalid_field", "Content-Length is not a number")
        if int(declared) > cap:
            raise _Rejected(413, "body_too_large",
                            f"body of {declared} bytes exceeds the limit of {cap}")
    body = bytearray()
    async for chunk in request.stream():   # a chunked body declares no length: count it
        body += chunk
        if len(body) > cap:
            raise _Rejected(413, "body_too_large", f"body exceeds the limit of {cap} bytes")
    return bytes(body)


def create_app(config: CollectorConfig, store: DirectiveStore,
               metrics: CollectorMetrics) -> Starlette:
    """Build the ASGI application.

    Args:
        config: the collector's configuration (the token is read from it once, here).
        store: the directive store.
        metrics: the counters to update.

    Returns:
        The Starlette application.
    """
    token = config.token().encode()

    def denied(request: Request) -> JSONResponse | None:
        if _authorized(request, token):
            return None
        return JSONResponse({"error": "unauthorized", "message": "missing or wrong bearer token"},
                            status_code=401, headers={"WWW-Authenticate": "Bearer"})

    async def alerts(request: Request) -> Response:
        try:
            if denied(request) is not None:
                raise _Rejected(401, "unauthorized", "missing or wrong bearer token")
            body = await _read_capped(request, config.max_body_bytes)
            try:
                notification = parse_notification(body)
            except PayloadError as exc:
                raise _Rejected(400, exc.reason, exc.message) from None
        except _Rejected as exc:
            metrics.webhooks_rejected.labels(exc.reason).inc()
            log.warning("webhook rejected (%d %s): %s", exc.status, exc.reason, exc.message)
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
            return JSONResponse({"error": exc.reason, "message": exc.message},
                                status_code=exc.status, headers=headers)
        outcomes, issued = await run_in_threadpool(store.submit, notification)
        metrics.webhooks_accepted.inc()
        for outcome, n in outcomes.items():
            metrics.alerts.labels(outcome).inc(n)
        for d in issued:
            metrics.directives_issued.labels(d.action).inc()
            log.info("directive %s issued: %s for job %r (alert %s)", d.id, d.action, d.job,
                     d.labels.get("alertname", "?"))
        return JSONResponse({"outcomes": dict(outcomes), "issued": [d.id for d in issued]})

    async def directives(request: Request) -> Response:
        if (refusal := denied(request)) is not None:
            return refusal
        job = request.query_params.get("job")
        if not job:
            return JSONResponse({"error": "missing_field", "message": "query parameter 'job' "
                                 "is required"}, status_code=400)
        return JSONResponse({"job": job, "directives": [d.to_json() for d in store.pending(job)]})

    async def acknowledge(request: Request) -> Response:
        if (refusal := denied(request)) is not None:
            return refusal
        found = await run_in_threadpool(store.acknowledge, request.path_params["id"])
        if found is None:
            return JSONResponse({"error": "not_found", "message": "no such directive"},
                                status_code=404)
        directive, now = found
        if now:
            metrics.directives_acknowledged.labels(directive.action).inc()
            log.info("directive %s acknowledged by job %r", directive.id, directive.job)
        return JSONResponse({"directive": directive.to_json(), "acknowledged": now})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "directives": store.counts()})

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[
        Route("/alerts", alerts, methods=["POST"]),
        Route("/directives", directives, methods=["GET"]),
        Route("/directives/{id}/ack", acknowledge, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ])


class CollectorServer:
    """The collector served by uvicorn: ``run()`` in the foreground, or ``start()`` a thread.

    Args:
        config: the configuration (``port=0`` picks a free port; see ``port`` once started).
        registry: passed to ``CollectorMetrics`` (default: a fresh registry).
    """

    def __init__(self, config: CollectorConfig, registry=None) -> None:
        self.config = config
        self.store = DirectiveStore(config.state_dir)
        self.metrics = CollectorMetrics(self.store, registry)
        app = create_app(config, self.store, self.metrics)
        self._server = uvicorn.Server(uvicorn.Config(
            app, host=config.host, port=config.port, lifespan="off", server_header=False,
            access_log=config.access_log, log_config=None))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """Returns: the port bound (meaningful once started)."""
        return self._server.servers[0].sockets[0].getsockname()[1]

    def run(self) -> None:
        """Serve until interrupted (SIGINT/SIGTERM stop it gracefully)."""
        self._server.run()

    def start(self, timeout_s: float = 10.0) -> "CollectorServer":
        """Serve in a daemon thread.

        Args:
            timeout_s: how long to wait for the socket to be listening.

        Returns:
            self, listening.
        """
        self._thread = threading.Thread(target=self._server.run, name="torchvitals-collector",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the collector did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread started by ``start()`` and wait for it (at most ``timeout_s``)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)


def serve(config: CollectorConfig) -> int:
    """Run the collector in the foreground until SIGINT or SIGTERM.

    Args:
        config: the configuration.

    Returns:
        The exit status: 0 after a clean stop, 2 when the token or the state cannot be read.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server = CollectorServer(config)
    except (OSError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    log.info("directives in %s: %s", config.state_dir, server.store.counts())
    server.run()
    return 0
