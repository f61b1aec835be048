"""Directives from the collector, polled off the training thread by global rank 0.

    watch(..., collector_url="http://127.0.0.1:9500", collector_job="train-a")
    # token: the job's own token (the collector's job tokens hold it), in
    # TORCHVITALS_WEBHOOK_TOKEN or a file named by TORCHVITALS_WEBHOOK_TOKEN_FILE (a mounted
    # secret); never a setting, so it never lands in a log

A daemon thread asks ``GET /directives?job=...&run=...`` every ``collector_poll_seconds``; the
run identity (``run_identity()``) lets the collector deliver a directive only to the run it was
issued for, never to a later run that reuses the job name. A collector that is down, or that
refuses the token, is logged once per outage (with its reason) and counted, never a training
failure. The oldest pending
directive rides the next step's reduction as a code that only rank 0 contributes, so every rank
acts on it in the same step; rank 0 then acknowledges it, again off the training thread.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping
from typing import Any

from ...protocol import ACTIONS, JOB_ID_ENVS, RUN_PARAM, token_from_env
from ...records.jobid import job_identity

log = logging.getLogger(__name__)

RUN_ID_ENVS = JOB_ID_ENVS
"""Variables naming the run, first set wins: ours, torchrun's rendezvous id, Slurm's job id
(the job identity's, ``jobid.job_identity``)."""

_PROCESS_RUN = uuid.uuid4().hex
"""The run identity of this process when no variable names one."""


def run_identity(environ: Mapping[str, str] | None = None) -> str:
    """The identity of this run, as the collector binds directives to it.

    The job's identity (``jobid.job_identity``), the same the ledger records.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        The first of ``RUN_ID_ENVS`` that is set (torchrun's ``none`` of a static rendezvous
        names nothing), else an id made once per process: then a restarted process is a new
        run and receives none of its predecessor's directives.
    """
    return job_identity(environ) or _PROCESS_RUN


class DirectivePoller:
    """Rank 0's link to the collector: the pending directive, acknowledgements, failure count.

    Args:
        url: the collector's base URL.
        job: the job name directives are addressed to.
        poll_seconds: seconds between polls.
        token: the job's bearer token (default: ``token_from_env()``).
        run: this run's identity (default: ``run_identity()``).
    """

    def __init__(
        self,
        url: str,
        job: str,
        poll_seconds: float,
        token: str | None = None,
        run: str | None = None,
    ):
        self.url, self.job, self.poll_seconds = url.rstrip("/"), job, poll_seconds
        self._token = token if token is not None else token_from_env()
        self.run = run if run is not None else run_identity()
        self._lock = threading.Lock()
        self._pending: dict[str, Any] | None = None
        self._taken: set[str] = set()
        self.failures = 0
        self._down = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="torchvitals-directives", daemon=True
        )
        self._thread.start()

    def code(self) -> float:
        """The pending directive's action code for this step's reduction (0 when none)."""
        with self._lock:
            return ACTIONS.get(self._pending["action"], 0.0) if self._pending else 0.0

    def take(self) -> dict[str, Any] | None:
        """The directive the job acts on now; acknowledged in the background.

        Taken and remembered as taken in one hold of the lock: a poll that lands between the two
        would find no directive pending and this one not yet taken, install it again, and the job
        would obey it twice (a second rollback, an abort after the rollback it ordered).
        """
        with self._lock:
            directive, self._pending = self._pending, None
            if directive is not None:
                self._taken.add(directive["id"])
        if directive is not None:
            threading.Thread(target=self._ack, args=(directive["id"],), daemon=True).start()
        return directive

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.poll()

    def poll(self) -> None:
        """Ask the collector once; the oldest directive not yet taken becomes pending (the
        background thread's loop, every ``poll_seconds``)."""
        try:
            query = urllib.parse.urlencode({"job": self.job, RUN_PARAM: self.run})
            body = self._request("GET", f"/directives?{query}")
        except (OSError, ValueError) as exc:
            self._failed("poll", exc)
            return
        self._recovered()
        with self._lock:  # _taken is read under the lock that take() adds to it under
            known = [
                d
                for d in body.get("directives", [])
                if d.get("action") in ACTIONS and d.get("id") not in self._taken
            ]
            if self._pending is None and known:
                self._pending = known[0]

    def _ack(self, directive_id: str) -> None:
        for _ in range(5):
            try:
                self._request("POST", f"/directives/{urllib.parse.quote(directive_id)}/ack")
                return
            except (OSError, ValueError) as exc:
                self._failed("acknowledge", exc)
                if self._stop.wait(self.poll_seconds):
                    return

    def _request(self, method: str, path: str) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            method=method,
            data=b"" if method == "POST" else None,
            headers={"Authorization": f"Bearer {self._token}"},
        )
        with urllib.request.urlopen(req, timeout=max(1.0, self.poll_seconds)) as resp:
            return json.loads(resp.read().decode() or "{}")

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        if not self._down:
            self._down = True
            reason = _http_reason(exc) if isinstance(exc, urllib.error.HTTPError) else str(exc)
            log.warning(
                "torchvitals: cannot %s directives at %s (%s); training goes on, "
                "retrying every %.1fs",
                what,
                self.url,
                reason,
                self.poll_seconds,
            )

    def _recovered(self) -> None:
        if self._down:
            self._down = False
            log.warning("torchvitals: the collector at %s answers again", self.url)


def _http_reason(exc: urllib.error.HTTPError) -> str:
    """``HTTP 403: <the collector's message>`` (it names the job, never the token)."""
    try:
        message = json.loads(exc.read().decode() or "{}").get("message", "")
    except (OSError, ValueError, AttributeError):
        message = ""
    return f"HTTP {exc.code}: {message}" if message else f"HTTP {exc.code}"
