"""A run's job records: its incidents and its goodput, for the report and the diagnosis.

    records = read_job_records("torchvitals_runs/<run>", job_dirs=["ckpt"])
    records.incidents, records.goodput

The run folder (``<log_dir>/<run_name>``, where the event log is) and the job folder (where the
supervisors and global rank 0 write ``incidents/`` and ``goodput/``: the ``checkpoint_dir`` they
share, or the run folder without one) differ when the job checkpoints elsewhere. The event log
does not name the job folder, so the places looked in are, in order: the folders named
(``--job-dir``), the run folder, and the folder of the watchdog's ledger (``ledger.json`` lives
in the checkpoint folder: the one named by ``--ledger``, or found in or just below the run
folder). Torch-free: ``torchvitals report`` and ``diagnose`` run where torch is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ...protocol import LEDGER_FILE
from ...records.goodput import Goodput, account
from ...records.incidents import FOLDER as INCIDENTS_FOLDER
from ...records.incidents import Incident, IncidentLog
from ...records.timeline import FOLDER as GOODPUT_FOLDER


@dataclass(frozen=True)
class JobRecords:
    """What the job folders hold about the run's disruptions and their cost."""

    folders: tuple[Path, ...]
    """The folders looked in, in order (existing ones only)."""
    incidents: tuple[Incident, ...]
    """Every incident found, oldest detection first; a key found in two folders counts once."""
    problems: tuple[str, ...]
    """One line per record that could not be read (the file and the field named)."""
    goodput: Goodput | None
    """The accounting of the first folder holding goodput records (None: none does, or it
    failed; ``goodput_note`` says which)."""
    goodput_note: str = ""
    """Why there is no goodput ("" when there is)."""

    def lost_seconds(self, incident: Incident) -> float | None:
        """What ``incident`` cost: its record's figure, else the accounting's."""
        if incident.lost_seconds is not None:
            return incident.lost_seconds
        costs = {c.key: c.lost_seconds for c in self.goodput.incidents} if self.goodput else {}
        return costs.get(incident.key)


def find_ledger(run_dir: str | os.PathLike) -> Path | None:
    """The watchdog's ledger of a run folder: ``ledger.json`` in it or in one of its
    sub-folders (a ``checkpoint_dir`` under the run folder)."""
    run_dir = Path(run_dir)
    for path in [run_dir / LEDGER_FILE, *sorted(run_dir.glob(f"*/{LEDGER_FILE}"))]:
        if path.is_file():
            return path
    return None


def job_folders(
    run_dir: str | os.PathLike,
    job_dirs: Iterable[str | os.PathLike] = (),
    *,
    ledger: str | os.PathLike | None = None,
) -> list[Path]:
    """The folders that may hold the run's ``incidents/`` and ``goodput/``, in the order they
    are trusted: ``job_dirs``, the run folder, the ledger's folder (``ledger``, else the one
    ``find_ledger`` finds). Missing folders and repeats (by real path) are left out.

    Raises:
        NotADirectoryError: a folder of ``job_dirs`` is not one (a typo must not pass silently).
    """
    named = [Path(d) for d in job_dirs]
    for folder in named:
        if not folder.is_dir():
            raise NotADirectoryError(f"--job-dir {folder}: not a folder")
    book = Path(ledger) if ledger is not None else find_ledger(run_dir)
    candidates = [*named, Path(run_dir)] + ([book.parent] if book is not None else [])
    found: list[Path] = []
    seen: set[Path] = set()
    for folder in candidates:
        real = folder.resolve()
        if folder.is_dir() and real not in seen:
            seen.add(real)
            found.append(folder)
    return found


def read_incidents(folders: Iterable[Path]) -> tuple[list[Incident], list[str]]:
    """Every folder's incidents (the first folder's record of a key wins), oldest first, and
    the problem lines of the records that could not be read."""
    by_key: dict[str, Incident] = {}
    problems: list[str] = []
    for folder in folders:
        if not (folder / INCIDENTS_FOLDER).is_dir():
            continue
        found, bad = IncidentLog(folder).read()
        problems += bad
        for incident in found:
            by_key.setdefault(incident.key, incident)
    return sorted(by_key.values(), key=lambda i: (i.detected_at, i.key)), problems


def read_goodput(folders: Iterable[Path]) -> tuple[Goodput | None, str]:
    """The accounting of the first folder with goodput records, or None and why not."""
    for folder in folders:
        if not any((folder / GOODPUT_FOLDER).glob("*.jsonl")):
            continue
        try:
            return account(folder), ""
        except (OSError, ValueError) as exc:  # GoodputError is a ValueError
            return None, f"{folder / GOODPUT_FOLDER}: {exc}"
    return None, "no goodput records (goodput/ in the job folder: pass --job-dir)"


def read_job_records(
    run_dir: str | os.PathLike,
    job_dirs: Iterable[str | os.PathLike] = (),
    *,
    ledger: str | os.PathLike | None = None,
) -> JobRecords:
    """The run's incidents and goodput, from every folder ``job_folders`` names.

    Raises:
        NotADirectoryError: a folder of ``job_dirs`` is not one.
    """
    folders = job_folders(run_dir, job_dirs, ledger=ledger)
    incidents, problems = read_incidents(folders)
    goodput, note = read_goodput(folders)
    return JobRecords(tuple(folders), tuple(incidents), tuple(problems), goodput, note)
