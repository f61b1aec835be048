"""The directive store: firing alerts become at most one directive each, kept on disk, bounded.

    python -m pytest tests/integration/test_collector_bounds.py

A directive is an order for a job (``rollback`` or ``abort``) issued from one alert. Its id is
derived from the alert's fingerprint and startsAt, so Alertmanager's repeats and its HA
replicas' duplicates map onto the directive already issued, also after a collector restart.

The state is ``<state_dir>/directives.sqlite3`` (SQLite from the standard library, WAL, one
transaction per change): a post appends to the log and touches the rows it changes, so its cost
does not grow with what is stored, where rewriting one JSON file per post did. The state stays
bounded:

- a directive is **pending** until its job acknowledges it, or until ``ttl_s`` passes: then it
  is **expired**, never delivered. Acknowledged and expired directives are remembered
  ``retention_s`` (so a repeat of a still-firing alert orders nothing twice), or until their
  alert is reported resolved (no repeat can follow), and then deleted;
- at most ``max_jobs`` jobs and ``max_directives_per_job`` directives per job; an order beyond
  them refuses the whole notification (``StoreFull``) and changes nothing stored.

**Runs.** A job name is reused by the runs that follow (a restarted script, a resubmitted
batch job), so a directive is bound to the run it was issued for: the run that last polled for
its job with a run identity (``pending(job, run)``). It is delivered to that run only; a new run
of the same name sees none of its predecessor's directives. A directive issued before any run
of its job polled is bound to the first run that receives it. A poll that names no run sees the
unbound directives and those of the run last seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import TorchvitalsError
from .webhook import Notification, order_of

FILE = "directives.sqlite3"
FORMAT = 2
"""Version of the database's layout (``PRAGMA user_version``); another one is refused."""

ISSUED, DUPLICATE, RESOLVED, RECORDED = "issued", "duplicate", "resolved", "recorded"
OUTCOMES = (ISSUED, DUPLICATE, RESOLVED, RECORDED)
"""What happened to one alert: a new directive, one already issued, a resolved alert (never
acted on), or a firing alert that orders nothing."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS directives (
    id TEXT PRIMARY KEY, job TEXT NOT NULL, action TEXT NOT NULL, fingerprint TEXT NOT NULL,
    starts_at TEXT NOT NULL, labels TEXT NOT NULL, issued_at REAL NOT NULL,
    acknowledged_at REAL, expired_at REAL, closed_at REAL, run TEXT);
CREATE INDEX IF NOT EXISTS directives_by_job ON directives (job, issued_at);
CREATE INDEX IF NOT EXISTS directives_open ON directives (issued_at) WHERE closed_at IS NULL;
CREATE INDEX IF NOT EXISTS directives_closed ON directives (closed_at)
    WHERE closed_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS jobs (job TEXT PRIMARY KEY, run TEXT, seen_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_by_seen ON jobs (seen_at);
"""
_COLUMNS = (
    "id, job, action, fingerprint, starts_at, labels, issued_at, acknowledged_at, expired_at, run"
)


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
    expired_at: float | None = None
    """Unix time (seconds) it expired undelivered; None unless it did."""
    run: str | None = None
    """The run identity it is bound to (None: the first run of its job that polls)."""

    def to_json(self) -> dict:
        """Returns: the directive as a JSON object (the HTTP API's form)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class StoreLimits:
    """The store's bounds (``CollectorConfig`` sets them)."""

    max_jobs: int = 1000
    max_directives_per_job: int = 100
    ttl_s: float = 3600.0
    """A pending directive expires this long after it was issued."""
    retention_s: float = 86400.0
    """An acknowledged or expired directive is deleted this long after it was closed."""


class StoreFull(TorchvitalsError):
    """An order the store's bounds refuse; ``reason`` is a short, bounded metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def directive_id(fingerprint: str, starts_at: str) -> str:
    """The id of the directive an alert yields.

    Args:
        fingerprint: the alert's fingerprint.
        starts_at: the alert's startsAt, verbatim.

    Returns:
        16 hex digits, stable across restarts and HA replicas.
    """
    return hashlib.sha256(f"{fingerprint}@{starts_at}".encode()).hexdigest()[:16]


def _short(name: str) -> str:
    return repr(name if len(name) <= 64 else name[:61] + "...")


class DirectiveStore:
    """Directives in ``<state_dir>/directives.sqlite3``, within ``limits``.

    Args:
        state_dir: folder of the database; created when missing, read when present.
        clock: returns Unix time in seconds (tests pass a fake).
        limits: the bounds on jobs, directives and time.
    """

    def __init__(
        self,
        state_dir: str | Path,
        clock: Callable[[], float] = time.time,
        limits: StoreLimits = StoreLimits(),
    ) -> None:
        folder = Path(state_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self._clock, self.limits = clock, limits
        self._lock = threading.Lock()
        # One connection behind one lock: the HTTP threads take turns, SQLite never sees two.
        self._db = sqlite3.connect(folder / FILE, isolation_level=None, check_same_thread=False)
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, FORMAT):
            raise ValueError(f"{folder / FILE}: unknown format {version!r}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a directive issued survives a power cut
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={FORMAT}")
        self._jobs = self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]

    # ------------------------------------------------------------------ plumbing

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction under the lock; any exception rolls it back (and the job count)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                self._jobs = self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
                raise
            self._db.execute("COMMIT")

    @staticmethod
    def _row(row: tuple) -> Directive:
        (id_, job, action, fingerprint, starts_at, labels, issued_at, acked, expired, run) = row
        return Directive(
            id=id_,
            job=job,
            action=action,
            fingerprint=fingerprint,
            starts_at=starts_at,
            labels=json.loads(labels),
            issued_at=issued_at,
            acknowledged_at=acked,
            expired_at=expired,
            run=run,
        )

    def _prune(self, db: sqlite3.Connection, now: float) -> None:
        """Expire what waited too long, forget what closed long ago: cost in rows changed."""
        db.execute(
            "UPDATE directives SET expired_at = ?, closed_at = ? "
            "WHERE closed_at IS NULL AND issued_at < ?",
            (now, now, now - self.limits.ttl_s),
        )
        db.execute(
            "DELETE FROM directives WHERE closed_at IS NOT NULL AND closed_at < ?",
            (now - self.limits.retention_s,),
        )
        gone = db.execute(
            "DELETE FROM jobs WHERE seen_at < ? AND NOT EXISTS "
            "(SELECT 1 FROM directives d WHERE d.job = jobs.job)",
            (now - self.limits.retention_s,),
        ).rowcount
        self._jobs -= gone

    def _admit(self, db: sqlite3.Connection, job: str, now: float) -> str | None:
        """Make room for one more directive of ``job``; returns the run it is bound to."""
        row = db.execute("SELECT run FROM jobs WHERE job = ?", (job,)).fetchone()
        if row is None:
            if self._jobs >= self.limits.max_jobs:
                raise StoreFull(
                    "too_many_jobs",
                    f"job {_short(job)} would be a new job beyond the limit of "
                    f"{self.limits.max_jobs} (max_jobs); nothing of this "
                    "notification was stored",
                )
            db.execute("INSERT INTO jobs (job, run, seen_at) VALUES (?, NULL, ?)", (job, now))
            self._jobs += 1
            return None
        db.execute("UPDATE jobs SET seen_at = ? WHERE job = ?", (now, job))
        cap = self.limits.max_directives_per_job
        held = db.execute("SELECT COUNT(*) FROM directives WHERE job = ?", (job,)).fetchone()[0]
        if held >= cap:
            # Closed directives are only remembered for deduplication: the oldest make room.
            db.execute(
                "DELETE FROM directives WHERE id IN (SELECT id FROM directives WHERE "
                "job = ? AND closed_at IS NOT NULL ORDER BY closed_at LIMIT ?)",
                (job, held - cap + 1),
            )
            held = db.execute("SELECT COUNT(*) FROM directives WHERE job = ?", (job,)).fetchone()[0]
            if held >= cap:
                raise StoreFull(
                    "too_many_directives",
                    f"job {_short(job)} already has {held} pending directives, the "
                    f"limit (max_directives_per_job); nothing of this notification "
                    "was stored",
                )
        return row[0]

    # ------------------------------------------------------------------ the API

    def submit(self, notification: Notification) -> tuple[Counter, list[Directive]]:
        """Act on a notification: issue a directive for each new firing alert that orders one.

        Args:
            notification: a validated webhook notification.

        Returns:
            The count of alerts per outcome (``OUTCOMES``) and the directives newly issued.

        Raises:
            StoreFull: an order would exceed ``max_jobs`` or ``max_directives_per_job``; the
                whole notification is refused and nothing stored changes.
        """
        outcomes: Counter = Counter()
        issued: list[Directive] = []
        now = self._clock()
        with self._transaction() as db:
            self._prune(db, now)
            for alert in notification.alerts:
                order = order_of(alert)
                if alert.status == "resolved":
                    outcomes[RESOLVED] += 1
                    # A resolved alert is never repeated: its closed directive can go now.
                    db.execute(
                        "DELETE FROM directives WHERE id = ? AND closed_at IS NOT NULL",
                        (directive_id(alert.fingerprint, alert.starts_at),),
                    )
                    continue
                if order is None:
                    outcomes[RECORDED] += 1
                    continue
                id_ = directive_id(order.fingerprint, order.starts_at)
                if db.execute("SELECT 1 FROM directives WHERE id = ?", (id_,)).fetchone():
                    outcomes[DUPLICATE] += 1
                    continue
                run = self._admit(db, order.job, now)
                d = Directive(
                    id=id_,
                    job=order.job,
                    action=order.action,
                    fingerprint=order.fingerprint,
                    starts_at=order.starts_at,
                    labels=dict(order.labels),
                    issued_at=now,
                    run=run,
                )
                db.execute(
                    f"INSERT INTO directives ({_COLUMNS}) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?)",
                    (
                        d.id,
                        d.job,
                        d.action,
                        d.fingerprint,
                        d.starts_at,
                        json.dumps(d.labels),
                        d.issued_at,
                        d.run,
                    ),
                )
                issued.append(d)
                outcomes[ISSUED] += 1
        return outcomes, issued

    def pending(self, job: str, run: str | None = None) -> list[Directive]:
        """The job's directives for this run that are neither acknowledged nor expired.

        Args:
            job: the ``job`` label the directives were issued for.
            run: the polling run's identity: recorded as the job's current run (new
                directives bind to it), and unbound pending directives bind to it now. None:
                nothing is recorded; the unbound directives and the current run's are returned.

        Returns:
            Oldest first.
        """
        now = self._clock()
        fresh = now - self.limits.ttl_s
        if run is not None:
            self._seen(job, run, now, fresh)
        query = (
            f"SELECT {_COLUMNS} FROM directives WHERE job = ? AND closed_at IS NULL "
            "AND issued_at >= ? AND (run IS NULL OR run = ?) ORDER BY issued_at, id"
        )
        with self._lock:
            if run is None:
                row = self._db.execute("SELECT run FROM jobs WHERE job = ?", (job,)).fetchone()
                current = None if row is None else row[0]
            else:
                current = run
            return [self._row(r) for r in self._db.execute(query, (job, fresh, current))]

    def _seen(self, job: str, run: str, now: float, fresh: float) -> None:
        """Record a poll of ``run``; writes only when something changes (or once in a while)."""
        with self._lock:
            row = self._db.execute("SELECT run, seen_at FROM jobs WHERE job = ?", (job,)).fetchone()
            unbound = self._db.execute(
                "SELECT 1 FROM directives WHERE job = ? AND run IS NULL AND closed_at IS NULL "
                "AND issued_at >= ? LIMIT 1",
                (job, fresh),
            ).fetchone()
            stale = row is not None and now - row[1] > self.limits.retention_s / 100
            if row is not None and row[0] == run and not unbound and not stale:
                return
            if row is None and self._jobs >= self.limits.max_jobs:
                return  # no room to remember this run; it has no directives either
        with self._transaction() as db:
            db.execute(
                "UPDATE directives SET run = ? WHERE job = ? AND run IS NULL "
                "AND closed_at IS NULL AND issued_at >= ?",
                (run, job, fresh),
            )
            if (
                db.execute(
                    "UPDATE jobs SET run = ?, seen_at = ? WHERE job = ?", (run, now, job)
                ).rowcount
                == 0
            ):
                db.execute("INSERT INTO jobs (job, run, seen_at) VALUES (?, ?, ?)", (job, run, now))
                self._jobs += 1

    def get(self, directive_id_: str) -> Directive | None:
        """Look a directive up.

        Args:
            directive_id_: the directive's id.

        Returns:
            The directive, or None when the id is unknown (or pruned).
        """
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM directives WHERE id = ?", (directive_id_,)
            ).fetchone()
        return None if row is None else self._row(row)

    def acknowledge(self, directive_id_: str) -> tuple[Directive, bool] | None:
        """Acknowledge a directive; acknowledging it again changes nothing.

        Args:
            directive_id_: the directive's id.

        Returns:
            The directive and whether this call acknowledged it (False when it already was),
            or None when the id is unknown.
        """
        now = self._clock()
        with self._transaction() as db:
            self._prune(db, now)
            changed = db.execute(
                "UPDATE directives SET acknowledged_at = ?, closed_at = COALESCE(closed_at, ?) "
                "WHERE id = ? AND acknowledged_at IS NULL",
                (now, now, directive_id_),
            ).rowcount
            row = db.execute(
                f"SELECT {_COLUMNS} FROM directives WHERE id = ?", (directive_id_,)
            ).fetchone()
        return None if row is None else (self._row(row), bool(changed))

    def stats(self) -> dict[str, int]:
        """Returns: the number of ``pending``, ``acknowledged`` and ``expired`` directives and
        of ``jobs`` (an expired one counts as expired once its time is up, pruned or not)."""
        fresh = self._clock() - self.limits.ttl_s
        with self._lock:
            pending, acked, expired = self._db.execute(
                "SELECT COUNT(*) FILTER (WHERE closed_at IS NULL AND issued_at >= ?), "
                "COUNT(acknowledged_at), "
                "COUNT(*) FILTER (WHERE acknowledged_at IS NULL AND (expired_at IS NOT NULL "
                "OR issued_at < ?)) FROM directives",
                (fresh, fresh),
            ).fetchone()
            return {
                "pending": pending,
                "acknowledged": acked,
                "expired": expired,
                "jobs": self._jobs,
            }

    def counts(self) -> dict[str, int]:
        """Returns: the number of ``pending`` and ``acknowledged`` directives (for /healthz)."""
        stats = self.stats()
        return {"pending": stats["pending"], "acknowledged": stats["acknowledged"]}

    def close(self) -> None:
        """Close the database (the store is unusable after)."""
        with self._lock:
            self._db.close()
