"""The timeline's record keys and the schema version every record of the job carries.

A timeline line is a JSON object with one-letter keys (a long job writes a million of them):
``{"v": 1, "e": "step", "s": 41, "t": 1733..., "d": 0.31, "w": 0.01, "c": 0.0, "x": "step"}``.
The keys are spelled here once; the writers (``timeline``) and the reader (``goodput``) use
these names. Incidents carry the version as ``"v"`` too, the ledger as ``"version"``.

A record without a version was written before the field existed: version 1. A reader meets a
version it does not know with ``RecordVersionError``, which names the version and what to do.
"""

from __future__ import annotations

from typing import Any

from ..errors import TorchvitalsError

SCHEMA_VERSION = 1
"""The version of every record this torchvitals writes (timeline lines, incidents, the
ledger). Bump it only together with a reader of the version before."""

VERSION = "v"
EVENT = "e"
"""What the line records: ``start``, ``step`` (steps files); ``wait``, ``attempt``, ``end``
(a supervisor's file)."""
STEP = "s"
TIME = "t"
"""Unix seconds: a step's end, a start, a supervisor's end."""
SECONDS = "d"
"""A step's duration, from the previous step's end."""
DATA_WAIT = "w"
CHECKPOINT = "c"
"""Seconds of the step spent saving or restoring a checkpoint."""
ACTION = "x"
"""What every rank did with the step (an ``Action``'s value)."""
RERUN = "r"
"""Seconds of the step spent computing it once more (a suspect step's re-run); absent: none."""
ATTEMPT = "a"
BEGAN = "t0"
ENDED = "t1"


class RecordVersionError(TorchvitalsError, ValueError):
    """A record of a schema version this torchvitals does not read (the message names it)."""


def version_of(record: dict[str, Any]) -> Any:
    """The record's schema version (1 where it has none: written before the field existed)."""
    return record.get(VERSION, 1)


def check_version(version: Any, where: str = "") -> None:
    """Raise ``RecordVersionError`` unless ``version`` is the one this torchvitals reads.

    Args:
        version: the record's (``version_of``).
        where: the file it came from, for the message (empty: the caller names it).
    """
    if version == SCHEMA_VERSION:
        return
    where = f"{where}: " if where else ""
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise RecordVersionError(
            f"{where}written with record schema version {version} by a newer torchvitals; "
            f"this one reads version {SCHEMA_VERSION}: read it with the torchvitals that wrote it"
        )
    raise RecordVersionError(
        f"{where}record schema version {version!r:.40} is not one this torchvitals reads "
        f"(version {SCHEMA_VERSION})"
    )
