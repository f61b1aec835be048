"""The directive store: firing alerts become at most one directive each, kept on disk.

    python -m pytest tests/integration/test_collector_webhook.py

A directive is an order for a job (``rollback`` or ``abort``) issued from one alert. Its id is
derived from the alert's fingerprint and startsAt, so Alertmanager's repeats and its HA
replicas' duplicates map onto the directive already issued, also after a collector restart.
Every directive, pending or acknowledged, is kept in ``<state_dir>/directives.json``, replaced
atomically on each change: forgetting an acknowledged one would let the next repeat of a
still-firing alert (every ``repeat_interval``) order a second rollback.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..agent.recover.durable import replace_json
from .webhook import Notification, order_of

FILE = "directives.json"
FORMAT = 1
"""Version of the file's layout; a file of another version is refused rather than misread."""

ISSUED, DUPLICATE, RESOLVED, RECORDED = "issued", "duplicate", "resolved", "recorded"
OUTCOMES = (ISSUED, DUPLICATE, RESOLVED, RECORDED)
"""What happened to one alert: a new directive, one already issued, a resolved alert (never
acted on), or a firing alert that orders nothing."""


@dataclass(frozen=True)
class Directive:
    """An order for a job, from one firing alert."""

    id: str
    job: str
    action: str
    fingerprint: str
    starts_at: str
    labels: dict[str, str]
    issued_at: float
    """Unix time (seconds) the collector issued it."""
    acknowledged_at: float | None = None
    """Unix time (seconds) the job acknowledged it; None while pending."""

    def to_json(self) -> dict:
        """Returns: the directive as a JSON object (the HTTP API and the state file share it)."""
        return dataclasses.asdict(self)


def directive_id(fingerprint: str, starts_at: str) -> str:
    """The id of the directive an alert yields.

    Args:
        fingerprint: the alert's fingerprint.
        starts_at: the alert's startsAt, verbatim.

    Returns:
        16 hex digits, stable across restarts and HA replicas.
    """
    return hashlib.sha256(f"{fingerprint}@{starts_at}".encode()).hexdigest()[:16]


class DirectiveStore:
    """Issued and acknowledged directives, in memory and in ``<state_dir>/directives.json``.

    Args:
        state_dir: folder of the state file; created when missing, read when present.
        clock: returns Unix time in seconds (tests pass a fake).
    """

    def __init__(self, state_dir: str | Path, clock: Callable[[], float] = time.time) -> None:
        self._path = Path(state_dir) / FILE
        self._clock = clock
        self._lock = threading.Lock()
        self._directives: dict[str, Directive] = self._load()

    def _load(self) -> dict[str, Directive]:
        if not self._path.exists():
            return {}
        state = json.loads(self._path.read_text(encoding="utf-8"))
        if state.get("format") != FORMAT:
            raise ValueError(f"{self._path}: unknown format {state.get('format')!r}")
        return {d["id"]: Directive(**d) for d in state["directives"]}

    def _commit(self, directives: dict[str, Directive]) -> None:
        """Write ``directives`` to disk, then adopt them: a failed write changes nothing, so
        Alertmanager's retry of the notification finds the alert still new."""
        replace_json(self._path, {"format": FORMAT,
                                  "directives": [d.to_json() for d in directives.values()]},
                     indent=1)
        self._directives = directives

    def submit(self, notification: Notification) -> tuple[Counter, list[Directive]]:
        """Act on a notification: issue a directive for each new firing alert that orders one.

        Args:
            notification: a validated webhook notification.

        Returns:
            The count of alerts per outcome (``OUTCOMES``) and the directives newly issued.
        """
        outcomes: Counter = Counter()
        issued: list[Directive] = []
        with self._lock:
            known = dict(self._directives)
            for alert in notification.alerts:
                order = order_of(alert)
                if alert.status == "resolved":
                    outcomes[RESOLVED] += 1
                elif order is None:
                    outcomes[RECORDED] += 1
                elif directive_id(order.fingerprint, order.starts_at) in known:
                    outcomes[DUPLICATE] += 1
                else:
                    d = Directive(id=directive_id(order.fingerprint, order.starts_at),
                                  job=order.job, action=order.action,
                                  fingerprint=order.fingerprint, starts_at=order.starts_at,
                                  labels=dict(order.labels), issued_at=self._clock())
                    known[d.id] = d
                    issued.append(d)
                    outcomes[ISSUED] += 1
            if issued:
                self._commit(known)
        return outcomes, issued

    def pending(self, job: str) -> list[Directive]:
        """The job's directives not yet acknowledged.

        Args:
            job: the ``job`` label the directives were issued for.

        Returns:
            Oldest first.
        """
        with self._lock:
            found = [d for d in self._directives.values()
                     if d.job == job and d.acknowledged_at is None]
        return sorted(found, key=lambda d: (d.issued_at, d.id))

    def get(self, directive_id_: str) -> Directive | None:
        """Look a directive up.

        Args:
            directive_id_: the directive's id.

        Returns:
            The directive, or None when the id is unknown.
        """
        with self._lock:
            return self._directives.get(directive_id_)

    def acknowledge(self, directive_id_: str) -> tuple[Directive, bool] | None:
        """Acknowledge a directive; acknowledging it again changes nothing.

        Args:
            directive_id_: the directive's id.

        Returns:
            The directive and whether this call acknowledged it (False when it already was),
            or None when the id is unknown.
        """
        with self._lock:
            d = self._directives.get(directive_id_)
            if d is None:
                return None
            if d.acknowledged_at is not None:
                return d, False
            d = dataclasses.replace(d, acknowledged_at=self._clock())
            self._commit({**self._directives, d.id: d})
            return d, True

    def counts(self) -> dict[str, int]:
        """Returns: the number of ``pending`` and ``acknowledged`` directives (for /metrics)."""
        with self._lock:
            acked = sum(d.acknowledged_at is not None for d in self._directives.values())
            return {"pending": len(self._directives) - acked, "acknowledged": acked}
