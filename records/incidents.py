"""Incidents: one record per disruption of a job, in the job's folder, written once.

    torchvitals incidents ckpt/                       # a person reads them
    log = IncidentLog(job_folder)                     # the agent and the supervisors write them
    log.record(Incident(kind=HANG, key="hang-a0002", step=41, culprit=Culprit(rank=3, node=1),
                        cause="rank 3 is stopped (SIGSTOP)", evidence={...}, detected_at=t))
    log.update("hang-a0002", recovered_at=time.time(), lost_seconds=38.5)

Every disruption (a hang, a crash, a lost node, a non-finite step, a loss spike, a straggler, a
diverging replica, an abort) is one JSON file ``<folder>/incidents/<key>.json``. The ``key``
names the disruption, not the writer (``hang-a0002``: the hang that ended attempt 2), so when
every node's supervisor sees the same hang, the first to write it wins and the others' writes
are refused (``record`` returns False): an exclusive create made atomic by a hard link, which
shared filesystems (NFS included) honour. The owner may later fill in what it learns after
(``recovered_at``, ``lost_seconds``) with ``update``.

The folder is the job's (the ``checkpoint_dir`` every rank and supervisor shares, or the run's
folder without one). It is bounded: at most ``limit`` records are kept, the oldest removed
first, and each record's evidence is cut to ``EVIDENCE_MAX_BYTES``. Records are plain JSON read
back field by field, checked for type; nothing in them is executed. Torch-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TorchvitalsError
from .durable import create_json, replace_json
from .schema import SCHEMA_VERSION, VERSION, check_version, version_of
from .vocabulary import (
    KINDS,
)

log = logging.getLogger("torchvitals.incidents")

FOLDER = "incidents"
"""The incidents' sub-folder of the job's folder."""

DEFAULT_LIMIT = 1000
"""Records kept per job; the oldest go first."""

EVIDENCE_MAX_BYTES = 32_768
"""A record's evidence, as JSON, is cut to this (a stack of every hung rank of a big node fits;
a runaway string does not fill the disk)."""

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class IncidentError(TorchvitalsError, ValueError):
    """A record that is not an incident (the message names the file and the field)."""


@dataclass(frozen=True, kw_only=True)
class Culprit:
    """Who caused it; None where it is truly unknown (a lost node has no rank)."""

    rank: int | None = None
    """The global rank."""
    node: int | None = None
    """The node rank (torchrun's ``--node-rank``, the supervisor's)."""
    host: str | None = None
    pid: int | None = None

    def describe(self, *, pid: bool = True) -> str:
        """``rank 3 (node 1, host h, pid 4711)``, or ``node 1 (host h)``, or ``unknown``; without
        the pid when ``pid`` is False (a lead line a person reads)."""
        shown = (("node", self.node), ("host", self.host), ("pid", self.pid if pid else None))
        where = [f"{k} {v}" for k, v in shown if v is not None]
        if self.rank is not None:
            return f"rank {self.rank}" + (f" ({', '.join(where)})" if where else "")
        if where:
            return f"{where[0]}" + (f" ({', '.join(where[1:])})" if where[1:] else "")
        return "unknown"


@dataclass(frozen=True, kw_only=True)
class Incident:
    """One disruption of the job."""

    kind: str
    """One of ``KINDS``."""
    key: str
    """Names the disruption (``hang-a0002``, ``nonfinite-s00041``): one record per key."""
    step: int | None
    """The step the job had reached when it happened (None: before the first)."""
    culprit: Culprit
    cause: str
    """One line a person reads first."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """What proves it: a stack, an exit status, a block, the values and thresholds."""
    detected_at: float
    """Unix seconds: the fault was seen (the verdict, the hang clock, the exit)."""
    localized_at: float | None = None
    """Unix seconds: the culprit was named (None: it could not be)."""
    recovered_at: float | None = None
    """Unix seconds: the job trained again (a rollback restored, a restart's first step)."""
    lost_seconds: float | None = None
    """Wall time the disruption cost the job (detection, restart, work done again)."""
    attempt: int | None = None
    """The supervisor's attempt it happened in (None: unsupervised)."""
    writer: str = ""
    """Who wrote it (``supervisor node 1``, ``agent rank 0``)."""
    remedy: str | None = None
    """What the job did about it, in the ladder's words (``vocabulary.REMEDIES``: ``none``,
    ``skip_update``, ``rollback``, ``abort``); None: a restart's (the supervisor's) or not
    known yet."""
    repeat_of: str | None = None
    """The key of the earlier incident whose rollback did not cure the run, when this one is its
    repeat (the rollback went further back); None: a first."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise IncidentError(f"kind: {self.kind!r} is not one of {', '.join(KINDS)}")
        if not _KEY.match(self.key):
            raise IncidentError(f"key: {self.key!r} is not a file-safe name")

    def to_dict(self) -> dict[str, Any]:
        """The record as its file holds it: every field, and the schema version ``v``."""
        out = {VERSION: SCHEMA_VERSION, **dataclasses.asdict(self)}
        out["evidence"] = _bounded(self.evidence)
        for optional in ("remedy", "repeat_of"):  # the agent's, once known: absent otherwise
            if out[optional] is None:
                del out[optional]
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "incident") -> Incident:
        """Read a record back, checking every field's type.

        Raises:
            IncidentError: a field is missing or of the wrong type (named, with ``where``).
            RecordVersionError: a record of a schema version this torchvitals does not read.
        """
        if not isinstance(d, dict):
            raise IncidentError(f"{where}: not a JSON object")
        check_version(version_of(d), where)
        culprit = d.get("culprit") or {}
        if not isinstance(culprit, dict):
            raise IncidentError(f"{where}: culprit: not an object")
        try:
            return cls(
                kind=_typed(d, "kind", str, where),
                key=_typed(d, "key", str, where),
                step=_typed(d, "step", int, where, optional=True),
                culprit=Culprit(
                    rank=_typed(culprit, "rank", int, where, optional=True),
                    node=_typed(culprit, "node", int, where, optional=True),
                    host=_typed(culprit, "host", str, where, optional=True),
                    pid=_typed(culprit, "pid", int, where, optional=True),
                ),
                cause=_typed(d, "cause", str, where),
                evidence=_typed(d, "evidence", dict, where, optional=True) or {},
                detected_at=_typed(d, "detected_at", float, where),
                localized_at=_typed(d, "localized_at", float, where, optional=True),
                recovered_at=_typed(d, "recovered_at", float, where, optional=True),
                lost_seconds=_typed(d, "lost_seconds", float, where, optional=True),
                attempt=_typed(d, "attempt", int, where, optional=True),
                writer=_typed(d, "writer", str, where, optional=True) or "",
                remedy=_typed(d, "remedy", str, where, optional=True),
                repeat_of=_typed(d, "repeat_of", str, where, optional=True),
            )
        except IncidentError as exc:
            if str(exc).startswith(where):
                raise
            raise IncidentError(f"{where}: {exc}") from None

    def line(self) -> str:
        """One line for a log or a terminal: kind, step, culprit (where named), cause."""
        step = "" if self.step is None else f" at step {self.step}"
        who = "" if self.culprit == Culprit() else f"{self.culprit.describe()}: "
        again = f" (a repeat of {self.repeat_of})" if self.repeat_of else ""
        return f"{self.kind}{step}: {who}{self.cause}{again}"


def _typed(d: dict, name: str, kind: type, where: str, *, optional: bool = False) -> Any:
    value = d.get(name)
    if value is None:
        if optional:
            return None
        raise IncidentError(f"{where}: {name}: missing")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise IncidentError(f"{where}: {name}: expected {kind.__name__}, got {value!r:.80}")
    if isinstance(value, float) and not math.isfinite(value):
        raise IncidentError(f"{where}: {name}: not a finite number")
    return value


def _bounded(evidence: dict[str, Any]) -> dict[str, Any]:
    """The evidence, its longest strings cut until its JSON fits ``EVIDENCE_MAX_BYTES``."""
    text = json.dumps(evidence, default=str)
    if len(text) <= EVIDENCE_MAX_BYTES:
        return json.loads(text)
    out = json.loads(text)
    size = max(200, EVIDENCE_MAX_BYTES // max(1, _count_strings(out)))
    while True:
        # JSON escapes a stack's newlines (and quotes, control characters) to two characters
        # or more: cut shorter until the escaped text fits, so a big stack keeps its innermost
        # frames rather than falling to the summary below.
        cut = _cut(out, size)
        if len(json.dumps(cut)) <= EVIDENCE_MAX_BYTES:
            return cut
        if size == 200:
            break
        size = max(200, size // 2)
    # Escaped once more inside the summary (at most doubled), it still fits.
    return {"truncated": True, "summary": json.dumps(cut)[: EVIDENCE_MAX_BYTES // 2 - 64]}


def _count_strings(value: Any) -> int:
    if isinstance(value, str):
        return 1
    if isinstance(value, dict):
        return sum(_count_strings(v) for v in value.values())
    if isinstance(value, list):
        return sum(_count_strings(v) for v in value)
    return 0


def _cut(value: Any, size: int) -> Any:
    if isinstance(value, str):
        # A stack's innermost frames are last: keep the end.
        return value if len(value) <= size else "[...]" + value[-size:]
    if isinstance(value, dict):
        return {k: _cut(v, size) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut(v, size) for v in value[:64]]
    return value


class IncidentLog:
    """The incidents of one job, in ``<folder>/incidents/``.

    Args:
        folder: the job's folder (the shared checkpoint folder, or the run's folder).
        limit: records kept; recording one more removes the oldest.
    """

    def __init__(self, folder: str | os.PathLike, *, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.path = Path(folder) / FOLDER
        self.limit = limit

    def record(self, incident: Incident) -> bool:
        """Write ``incident`` unless its key is already recorded (by any writer).

        Returns:
            Whether this call wrote it (False: another node or rank had).

        Raises:
            OSError: the folder cannot be written (a caller inside training logs it and goes on).
        """
        final = self._file(incident.key)
        if not create_json(final, incident.to_dict(), indent=1):
            return False  # another writer had it: one writer wins, whole or not at all
        log.warning("torchvitals incident: %s", incident.line())
        self._prune(keep=final)
        return True

    def update(self, key: str, **changes: Any) -> Incident | None:
        """Fill in what was learned after (``recovered_at``, ``lost_seconds``, ``evidence``...).

        Returns:
            The record as written, or None when ``key`` was never recorded (or is unreadable).
        """
        found = self.get(key)
        if found is None:
            return None
        updated = dataclasses.replace(found, **changes)
        replace_json(self._file(key), updated.to_dict(), indent=1, fsync=False)
        return updated

    def get(self, key: str) -> Incident | None:
        """The record of ``key``; None when absent or unreadable."""
        try:
            return _load(self._file(key))
        except (OSError, IncidentError, ValueError):
            return None

    def has(self, key: str) -> bool:
        return self._file(key).exists()

    def read(self) -> tuple[list[Incident], list[str]]:
        """Every record, oldest detection first, and one problem line per file that is not one.

        Returns:
            (incidents, problems): a problem names the file and the field.
        """
        found, problems = [], []
        for path in self._files():
            try:
                found.append(_load(path))
            except (OSError, ValueError) as exc:  # IncidentError and JSON errors included
                problems.append(f"{path}: {exc}")
        found.sort(key=lambda i: (i.detected_at, i.key))
        return found, problems

    def _file(self, key: str) -> Path:
        if not _KEY.match(key):
            raise IncidentError(f"key: {key!r} is not a file-safe name")
        return self.path / f"{key}.json"

    def _files(self) -> Iterator[Path]:
        if not self.path.is_dir():
            return iter(())
        return (p for p in self.path.glob("*.json") if not p.name.startswith("."))

    def _prune(self, keep: Path) -> None:
        files = list(self._files())
        if len(files) <= self.limit:
            return
        # Never the record just written: on a shared filesystem another node's clock may have
        # stamped older records later, and a coarse clock stamps several alike.
        files = sorted((f for f in files if f != keep), key=_mtime)
        for old in files[: len(files) + 1 - self.limit]:
            with contextlib.suppress(OSError):
                old.unlink()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _load(path: Path) -> Incident:
    if path.stat().st_size > 4 * EVIDENCE_MAX_BYTES:
        raise IncidentError(f"{path}: larger than any incident record")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise IncidentError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return Incident.from_dict(data, str(path))


def hostname() -> str:
    """This machine's name, as incidents and the node records spell it."""
    return socket.gethostname()
