"""Durable little files: JSON written with fsync, folders fsynced, atomic replacement.

A checkpoint or ledger that claims to be complete must be on disk before it is renamed into
place; these helpers are the pieces both use.
"""

from __future__ import annotations

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
