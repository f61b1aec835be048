"""A checkpoint folder's manifest: the size and SHA-256 of every other file, signed, written last.

    files = digests(tmp, names, ranks)              # collective: the hashing split over the ranks
    write_manifest(tmp, step, files, key)           # rank 0, as a save commits
    why = verify(folder, ranks, root, key, trust_unsigned)   # collective: None, or why not to load

A committed folder is named ``step-<8 or more digits>`` (``COMMITTED``); its ``manifest.json``
names that step and lists every file beside it. A load refuses a folder from its name and its
manifest alone first (renamed, partial, unsigned or signed under another key, a file missing or
planted: rank 0 reads it), then from the files' digests, which the ranks compute between them;
every rank gets the same answer. The signature is ``trust.py``'s.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ...records.durable import sha256_file, write_json
from .agreement import CheckpointError, Ranks, failures
from .trust import CheckpointKey

MANIFEST = "manifest.json"
COMMITTED = re.compile(r"step-(\d{8,})")
"""The name of a committed checkpoint folder (a save in progress is ``.tmp-step-...``)."""


def step_of(folder: Path) -> int:
    """The step a committed folder's name holds."""
    match = COMMITTED.fullmatch(folder.name)
    if match is None:
        raise ValueError(f"{folder.name!r} is not a committed checkpoint folder (step-NNNNNNNN)")
    return int(match.group(1))


def write_manifest(
    folder: Path, step: int, files: dict[str, tuple[int, str]], key: CheckpointKey | None
) -> None:
    """Write ``folder``'s manifest (fsynced; the caller fsyncs the folder).

    Args:
        folder: the checkpoint folder, every other file already in it.
        step: the step it holds.
        files: each file's ``(size, SHA-256)``.
        key: signs the manifest; None signs nothing.
    """
    manifest: dict[str, Any] = {
        "step": step,
        "files": {n: {"size": size, "sha256": digest} for n, (size, digest) in files.items()},
    }
    if key is not None:
        manifest["signature"] = key.sign(manifest)
    write_json(folder / MANIFEST, manifest)


def digests(folder: Path, names: list[str], ranks: Ranks) -> dict[str, tuple[int, str]]:
    """Size and SHA-256 of each file, the hashing split over the ranks; collective.

    Args:
        folder: the checkpoint folder.
        names: the files to hash (the same list on every rank).
        ranks: the ranks that share the hashing.

    Returns:
        Every file's ``(size, SHA-256)``, on every rank.

    Raises:
        CheckpointError: on every rank, when a file could not be read on some rank.
    """
    shares = ranks.gather(
        lambda: {n: sha256_file(folder / n) for n in names[ranks.rank :: ranks.world]}
    )
    if errors := failures(shares):
        raise CheckpointError(f"cannot read {folder}: {errors}")
    return {name: d for _, share in shares for name, d in share.items()}


def verify(
    folder: Path, ranks: Ranks, root: Path, key: CheckpointKey | None, trust_unsigned: bool
) -> str | None:
    """Why ``folder`` must not be loaded, or None; collective, the same answer on every rank.

    Args:
        folder: the checkpoint folder.
        ranks: the ranks that load it.
        root: the store's folder (named when rank 0 cannot read the listing).
        key: the job's key; None checks no signature.
        trust_unsigned: accept a manifest unsigned or signed under another key.

    Raises:
        CheckpointError: on every rank, when rank 0 failed to read the listing.
    """
    listing = ranks.on_leader(lambda: _listing_problem(folder, key, trust_unsigned), root)
    if isinstance(listing, str):
        return listing
    try:
        actual = digests(folder, sorted(listing), ranks)
    except CheckpointError as e:  # raised alike on every rank
        return str(e)
    return _digest_problem(listing, actual)


def _listing_problem(
    folder: Path, key: CheckpointKey | None = None, trust_unsigned: bool = False
) -> str | dict[str, dict[str, Any]]:
    """A reason to refuse ``folder`` from its names and its manifest alone (its signature
    included), or the manifest's files."""
    if not COMMITTED.fullmatch(folder.name):
        return "not a committed checkpoint folder (a .tmp-* folder is a save that never finished)"
    if not folder.is_dir():
        return "no such folder"
    if not (folder / MANIFEST).is_file():
        return f"no {MANIFEST}: a partial checkpoint"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"{MANIFEST} is unreadable or malformed ({type(e).__name__}: {e})"
    if manifest.get("step") != step_of(folder):
        return (
            f"{MANIFEST} says step {manifest.get('step')!r}, the folder's name step "
            f"{step_of(folder)}: a renamed or copied folder"
        )
    if key is not None and (why := key.verify(manifest)) is not None and not trust_unsigned:
        return (
            f"{why}; not loaded. Set the job's key (TORCHVITALS_CHECKPOINT_KEY or "
            "checkpoint_key_file) to the one it was saved with, or, for a folder you trust, "
            "trust_unsigned_checkpoints=True"
        )
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return f"{MANIFEST} is malformed (no file table)"
    present = {p.name for p in folder.iterdir()} - {MANIFEST}
    if missing := sorted(set(files) - present):
        return f"missing file {missing[0]} (listed in the manifest)"
    if unexpected := sorted(present - set(files)):
        return f"unexpected file {unexpected[0]} (not in the manifest)"
    return files


def _digest_problem(
    listing: dict[str, dict[str, Any]], actual: dict[str, tuple[int, str]]
) -> str | None:
    """The first file whose size or SHA-256 differs from the manifest's, or None."""
    for name, expected in sorted(listing.items()):
        size, digest = actual[name]
        if size != expected.get("size"):
            return f"{name}: {size} bytes, the manifest says {expected.get('size')}"
        if digest != expected.get("sha256"):
            return f"{name}: SHA-256 differs from the manifest (altered on disk)"
    return None
