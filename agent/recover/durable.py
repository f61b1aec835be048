"""Durable little files: JSON written with fsync, folders fsynced, atomic replacement.

A checkpoint or ledger that claims to be complete must be on disk before it is renamed into
place; these helpers are the pieces both use.
"""

from __future__ import annotations

import hashlib
import json
import os
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


def replace_json(path: Path, value: Any, indent: int | None = None) -> None:
    """Atomically replace ``path`` with ``value`` as JSON: temporary file, fsync, rename, fsync."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write_json(tmp, value, indent)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_file(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of a file, read in 1 MiB chunks."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return path.stat().st_size, sha.hexdigest()
