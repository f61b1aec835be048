"""The collector's HTTP service: Alertmanager webhook in, directives out, its own /metrics.

    torchvitals-collector            # or: python -m torchvitals.collector --help

Endpoints (every one but /healthz and /metrics needs ``Authorization: Bearer <token>``; which
token may do what is ``auth.py``'s: a token known to nobody is 401, a known one used beyond its
power 403, each with ``{"error": reason, "message": ...}``):

- ``POST /alerts`` (the webhook token only): an Alertmanager webhook (v4). 413 when the
  declared or streamed body exceeds ``max_body_bytes`` (refused before it is read), 400 when it
  is not a valid notification or a label is too large, 507 when it orders a job or a directive
  beyond the store's limits (nothing stored changes), else 200 with the count of alerts per
  outcome and the ids of the directives it issued.
- ``GET /directives?job=J[&run=R]`` (J's token only): ``{"job": J, "directives": [...]}``, the
  pending directives of J's run R (see ``directives.py`` for how a directive binds to a run).
- ``POST /directives/<id>/ack`` (the token of the directive's job only): acknowledge once;
  again returns 200 with ``"acknowledged": false``; 404 for an unknown id.
- ``GET /healthz``, ``GET /metrics``.

Starlette on uvicorn (h11): a maintained ASGI stack of two light packages, where the
standard library's ``http.server`` is documented as not meant for production. They come with
the ``collector`` extra (``pip install 'torchvitals[collector]'``) and are imported only when a
server is built, so importing ``torchvitals.collector`` needs neither.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import TorchvitalsError
from ..protocol import RUN_PARAM
from .auth import ALERTMANAGER, Principal, Tokens
from .config import CollectorConfig
from .directives import DirectiveStore, StoreFull, StoreLimits
from .metrics import CollectorMetrics
from .webhook import LabelLimits, PayloadError, parse_notification

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

log = logging.getLogger("torchvitals.collector")

EXTRA = "pip install 'torchvitals[collector]'"
"""What installs the HTTP stack (the ``collector`` extra of pyproject.toml)."""


class WebStackMissing(TorchvitalsError, ImportError):
    """starlette or uvicorn is not installed: the message says how to install them."""


def _require_web_stack() -> None:
    """Raise ``WebStackMissing`` unless starlette and uvicorn import."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise WebStackMissing(
            f"the collector's HTTP service needs starlette and uvicorn "
            f"({exc.name or exc} is missing), from the collector extra: "
            f"{EXTRA}"
        ) from exc


class _Rejected(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


MAX_RUN_BYTES = 256
"""Longest run identity a poll may name (a job id, a UUID: far shorter)."""


def _error(exc: _Rejected) -> JSONResponse:
    from starlette.responses import JSONResponse

    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(
        {"error": exc.reason, "message": exc.message}, status_code=exc.status, headers=headers
    )


def _principal(request: Request, tokens: Tokens) -> Principal:
    """Who the request's token speaks for; 401 when nobody."""
    principal = tokens.identify(request.headers.get("authorization"))
    if principal is None:
        raise _Rejected(401, "unauthorized", "missing or wrong bearer token")
    return principal


def _job_only(principal: Principal, job: str, verb: str) -> None:
    """403 unless ``principal`` is ``job``'s own token (``verb``: what it tried, for the reason)."""
    if principal.kind == ALERTMANAGER:
        raise _Rejected(
            403,
            "forbidden",
            f"the webhook token may post alerts only: to {verb} of a job, use that job's own token",
        )
    if principal.job != job:
        raise _Rejected(
            403,
            "forbidden",
            f"{principal.describe()} cannot {verb} of job "
            f"{job[:64]!r}: a job's token serves that job only",
        )


def store_limits(config: CollectorConfig) -> StoreLimits:
    """Args: config: the collector's configuration. Returns: the store's bounds from it."""
    return StoreLimits(
        max_jobs=config.max_jobs,
        max_directives_per_job=config.max_directives_per_job,
        ttl_s=config.directive_ttl_seconds,
        retention_s=config.retention_seconds,
    )


async def _read_capped(request: Request, cap: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``cap`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _Rejected(400, "invalid_field", "Content-Length is not a number")
        if int(declared) > cap:
            raise _Rejected(
                413, "body_too_large", f"body of {declared} bytes exceeds the limit of {cap}"
            )
    body = bytearray()
    async for chunk in request.stream():  # a chunked body declares no length: count it
        body += chunk
        if len(body) > cap:
            raise _Rejected(413, "body_too_large", f"body exceeds the limit of {cap} bytes")
    return bytes(body)


def create_app(
    config: CollectorConfig, store: DirectiveStore, metrics: CollectorMetrics
) -> Starlette:
    """Build the ASGI application.

    Args:
        config: the collector's configuration (the tokens are read from it once, here; the
            job tokens file again whenever it changes).
        store: the directive store.
        metrics: the counters to update.

    Returns:
        The Starlette application.

    Raises:
        TokenError: a token cannot be read, or a job's token is the webhook token.
        WebStackMissing: starlette or uvicorn is not installed.
    """
    _require_web_stack()
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    tokens = Tokens(config.token(), config.job_tokens, config.job_tokens_file)
    labels = LabelLimits(max_label_bytes=config.max_label_bytes, max_labels=config.max_labels)

    async def alerts(request: Request) -> Response:
        try:
            principal = _principal(request, tokens)
            if principal.kind != ALERTMANAGER:
                raise _Rejected(
                    403,
                    "forbidden",
                    f"{principal.describe()} may read and "
                    "acknowledge its own directives only; alerts need the webhook "
                    "token",
                )
            body = await _read_capped(request, config.max_body_bytes)
            try:
                notification = parse_notification(body, labels)
            except PayloadError as exc:
                raise _Rejected(400, exc.reason, exc.message) from None
            try:
                outcomes, issued = await run_in_threadpool(store.submit, notification)
            except StoreFull as exc:
                raise _Rejected(507, exc.reason, exc.message) from None
        except _Rejected as exc:
            metrics.webhooks_rejected.labels(exc.reason).inc()
            log.warning("webhook rejected (%d %s): %s", exc.status, exc.reason, exc.message)
            return _error(exc)
        metrics.webhooks_accepted.inc()
        for outcome, n in outcomes.items():
            metrics.alerts.labels(outcome).inc(n)
        for d in issued:
            metrics.directives_issued.labels(d.action).inc()
            log.info(
                "directive %s issued: %s for job %r (alert %s)",
                d.id,
                d.action,
                d.job,
                d.labels.get("alertname", "?"),
            )
        return JSONResponse({"outcomes": dict(outcomes), "issued": [d.id for d in issued]})

    async def directives(request: Request) -> Response:
        try:
            principal = _principal(request, tokens)
            job = request.query_params.get("job")
            if not job:
                raise _Rejected(400, "missing_field", "query parameter 'job' is required")
            _job_only(principal, job, "read the directives")
            run = request.query_params.get(RUN_PARAM) or None
            if run is not None and len(run.encode()) > MAX_RUN_BYTES:
                raise _Rejected(
                    400,
                    "invalid_field",
                    f"query parameter {RUN_PARAM!r} is over {MAX_RUN_BYTES} bytes",
                )
        except _Rejected as exc:
            return _error(exc)
        found = await run_in_threadpool(store.pending, job, run)
        return JSONResponse({"job": job, "directives": [d.to_json() for d in found]})

    async def acknowledge(request: Request) -> Response:
        try:
            principal = _principal(request, tokens)
            if principal.kind == ALERTMANAGER:
                _job_only(principal, "", "acknowledge the directives")
            known = await run_in_threadpool(store.get, request.path_params["id"])
            if known is None:
                raise _Rejected(404, "not_found", "no such directive")
            _job_only(principal, known.job, "acknowledge the directives")
        except _Rejected as exc:
            return _error(exc)
        found = await run_in_threadpool(store.acknowledge, known.id)
        if found is None:  # pruned between the two calls
            return _error(_Rejected(404, "not_found", "no such directive"))
        directive, now = found
        if now:
            metrics.directives_acknowledged.labels(directive.action).inc()
            log.info("directive %s acknowledged by job %r", directive.id, directive.job)
        return JSONResponse({"directive": directive.to_json(), "acknowledged": now})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "directives": store.counts()})

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/alerts", alerts, methods=["POST"]),
            Route("/directives", directives, methods=["GET"]),
            Route("/directives/{id}/ack", acknowledge, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
        ]
    )


class CollectorServer:
    """The collector served by uvicorn: ``run()`` in the foreground, or ``start()`` a thread.

    Args:
        config: the configuration (``port=0`` picks a free port; see ``port`` once started).
        registry: passed to ``CollectorMetrics`` (default: a fresh registry).
        clock: the store's clock, Unix seconds (tests pass a fake one to pass time).

    Raises:
        WebStackMissing: starlette or uvicorn is not installed (checked before the store is
            opened, so nothing is left half-built).
    """

    def __init__(
        self, config: CollectorConfig, registry=None, clock: Callable[[], float] = time.time
    ) -> None:
        _require_web_stack()
        import uvicorn

        self.config = config
        self.store = DirectiveStore(config.state_dir, clock=clock, limits=store_limits(config))
        self.metrics = CollectorMetrics(self.store, registry)
        app = create_app(config, self.store, self.metrics)
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                lifespan="off",
                server_header=False,
                access_log=config.access_log,
                log_config=None,
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """Returns: the port bound (meaningful once started)."""
        return self._server.servers[0].sockets[0].getsockname()[1]

    def run(self) -> None:
        """Serve until interrupted (SIGINT/SIGTERM stop it gracefully)."""
        self._server.run()

    def start(self, timeout_s: float = 10.0) -> CollectorServer:
        """Serve in a daemon thread.

        Args:
            timeout_s: how long to wait for the socket to be listening.

        Returns:
            self, listening.
        """
        self._thread = threading.Thread(
            target=self._server.run, name="torchvitals-collector", daemon=True
        )
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
        self.store.close()


def serve(config: CollectorConfig) -> int:
    """Run the collector in the foreground until SIGINT or SIGTERM.

    Args:
        config: the configuration.

    Returns:
        The exit status: 0 after a clean stop, 2 when the token or the state cannot be read or
        the collector extra is not installed.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server = CollectorServer(config)
    except (OSError, ValueError, sqlite3.Error, WebStackMissing) as exc:
        log.error("cannot start: %s", exc)
        return 2
    log.info("directives in %s: %s", config.state_dir, server.store.stats())
    server.run()
    return 0
