"""Directives from the collector, polled off the training thread by global rank 0.

    watch(..., collector_url="http://127.0.0.1:9500", collector_job="train-a")
    # token: TORCHVITALS_WEBHOOK_TOKEN, or a file named by TORCHVITALS_WEBHOOK_TOKEN_FILE (a
    # mounted secret); never a setting, so it never lands in a log

A daemon thread asks ``GET /directives?job=...`` every ``collector_poll_seconds``; a collector
that is down is logged once per outage and counted, never a training failure. The oldest pending
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
from typing import Any

from ...protocol import ACTIONS, token_from_env

log = logging.getLogger(__name__)

class DirectivePoller:
    """Rank 0's link to the collector: the pending directive, acknowledgements, failure count.

    Args:
        url: the collector's base URL.
        job: the job name directives are addressed to.
        poll_seconds: seconds between polls.
        token: bearer token (default: ``token_from_env()``).
    """

    def __init__(self, url: str, job: str, poll_seconds: float, token: str | None = None):
        self.url, self.job, self.poll_seconds = url.rstrip("/"), job, poll_seconds
        self._token = token if token is not None else token_from_env()
        self._lock = threading.Lock()
        self._pending: dict[str, Any] | None = None
        self._taken: set[str] = set()
        self.failures = 0
        self._down = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchvitals-directives", daemon=True)
        self._thread.start()

    def code(self) -> float:
        """The pending directive's action code for this step's reduction (0 when none)."""
        with self._lock:
            return ACTIONS.get(self._pending["action"], 0.0) if self._pending else 0.0

    def take(self) -> dict[str, Any] | None:
        """The directive the job acts on now; acknowledged in the background."""
        with self._lock:
            directive, self._pending = self._pending, None
        if directive is not None:
            self._taken.add(directive["id"])
            threading.Thread(target=self._ack, args=(directive["id"],), daemon=True).start()
        return directive

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                body = self._request("GET", f"/directives?job={urllib.parse.quote(self.job)}")
            except (OSError, ValueError) as exc:
                self._failed("poll", exc)
                continue
            self._recovered()
            known = [d for d in body.get("directives", [])
                     if d.get("action") in ACTIONS and d.get("id") not in self._taken]
            with self._lock:
                if self._pending is None and known:
                    self._pending = known[0]

    def _ack(self, directive_id: str) -> None:
        for _ in range(5):
            try:
                self._request("POST", f"/directives/{directive_id}/ack")
                return
            except (OSError, ValueError) as exc:
                self._failed("acknowledge", exc)
                if self._stop.wait(self.poll_seconds):
                    return

    def _request(self, method: str, path: str) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, method=method, data=b"" if method == "POST" else None,
                                     headers={"Authorization": f"Bearer {self._token}"})
        with urllib.request.urlopen(req, timeout=max(1.0, self.poll_seconds)) as resp:
            return json.loads(resp.read().decode() or "{}")

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        if not self._down:
            self._down = True
            reason = f"HTTP {exc.code}" if isinstance(exc, urllib.error.HTTPError) else str(exc)
            log.warning("torchvitals: cannot %s directives at %s (%s); training goes on, "
                        "retrying every %.1fs", what, self.url, reason, self.poll_seconds)

    def _recovered(self) -> None:
        if self._down:
            self._down = False
            log.warning("torchvitals: the collector at %s answers again", self.url)
