"""Durable little files: the one way a record file is written.

A checkpoint, the ledger, an incident or a heartbeat is never seen half-written: each is
written to a temporary file of its own in the same folder (two writers never share one),
renamed into place (``replace_json``) or linked there only if the name is free
(``create_json``), and, where it must survive a power cut, fsynced with its folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json(path: Path, value: Any, indent: int | None = None) -> None:
    """Write ``value`` as JSON to ``path`` and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=indent)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a folder, so a rename inside it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_json(path: Path, value: Any, indent: int | None = None, *, fsync: bool = True) -> None:
    """Atomically replace ``path`` with ``value`` as JSON: a temporary file, renamed into place.
    The folder must exist (a heartbeat whose folder was removed fails, and says so).

    ``fsync`` False skips the fsyncs of the file and the folder: for a file only this host reads
    while the job runs (a heartbeat), where a crash of the host ends the job anyway."""
    tmp = _temporary(path, value, indent, fsync)
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def create_json(path: Path, value: Any, indent: int | None = None) -> bool:
    """Write ``path`` with ``value`` as JSON unless it exists: whole or not at all, and of
    several writers racing for the name (on NFS too) exactly one wins.

    Returns:
        Whether this call created it (False: it existed, or another writer won).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return False
    tmp = _temporary(path, value, indent, fsync=False)
    try:
        os.link(tmp, path)  # fails if the name exists: an exclusive create that NFS honours
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _temporary(path: Path, value: Any, indent: int | None, fsync: bool) -> Path:
    """``value`` as JSON in a new hidden file beside ``path`` (``.<name>.<random>.tmp``)."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=indent)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


def sha256_file(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of a file, read in 1 MiB chunks."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return path.stat().st_size, sha.hexdigest()
