"""The recovery ledger: one JSON document in the checkpoint folder that a restart resumes from.

    ledger = Ledger("checkpoints/ledger.json").load()     # empty on a first run
    ledger.record_checkpoint(120, "checkpoints/step-00000120")
    ledger.record_rollback(131, to_step=120, reason="loss spike", lr_scale=0.5, skipped=(120, 140))
    ledger.lr_scale, ledger.skipped, ledger.is_skipped(125)          # 0.5, [(120, 140)], True

Every rank keeps the same ledger in memory (every rank takes the same decisions); only the
writer (global rank 0) writes the file: a temporary file, fsync, rename, fsync of the
folder, so a crash leaves the old document or the new one, never half of one. A file that does
not parse or does not match the schema is refused: starting over from an empty ledger would
replay skipped batches and forget the learning-rate back-off.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..errors import TorchvitalsError
from .durable import replace_json
from .schema import SCHEMA_VERSION, RecordVersionError, check_version

_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "checkpoint": {"step": (int,), "path": (str,), "time": (int, float)},
    "rollback": {
        "step": (int,),
        "to_step": (int,),
        "reason": (str,),
        "lr_scale": (int, float),
        "skipped": (list, type(None)),
        "time": (int, float),
    },
    "abort": {"step": (int,), "reason": (str,), "time": (int, float)},
    "distrust": {"step": (int,), "path": (str,), "reason": (str,), "time": (int, float)},
    "trust": {"step": (int,), "path": (str,), "clean_through": (int,), "time": (int, float)},
    "ramp": {"step": (int,), "lr_scale": (int, float), "time": (int, float)},
    "adopt": {
        "step": (int,),
        "source": (str,),
        "lr_scale": (int, float),
        "skipped": (list,),
        "time": (int, float),
    },
}


def _scale_ok(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= 1
    )


class LedgerError(TorchvitalsError, RuntimeError):
    """The ledger file exists but cannot be trusted."""


class SkipRanges:
    """Half-open batch index ranges ``[start, stop)`` never to be trained on, kept sorted.

    One object is shared by the ledger, which persists it, and the batch iterator, which drops
    the batches in it, so the two cannot disagree.
    """

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._ranges: list[tuple[int, int]] = sorted((int(a), int(b)) for a, b in ranges)

    def add(self, start: int, stop: int) -> None:
        """Never train on the batches with index in ``[start, stop)`` (empty ranges ignored)."""
        if stop > start:
            bisect.insort(self._ranges, (start, stop))

    def batches(self) -> int:
        """How many batch indices the ranges cover (an index in two ranges counts twice)."""
        return sum(stop - start for start, stop in self._ranges)

    def __contains__(self, index: object) -> bool:
        return any(start <= index < stop for start, stop in self._ranges)  # type: ignore[operator]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(list(self._ranges))

    def __len__(self) -> int:
        return len(self._ranges)

    def __eq__(self, other: object) -> bool:
        return (
            list(self) == [tuple(r) for r in other]
            if isinstance(other, (list, tuple, SkipRanges))
            else NotImplemented
        )

    def __repr__(self) -> str:
        return f"SkipRanges({self._ranges!r})"


class Ledger:
    """Healthy checkpoints, rollbacks, adopted states, aborts, the LR scale and the skipped
    batch ranges.

    Args:
        path: the JSON file, normally ``<checkpoint root>/ledger.json``.
        writer: whether this process writes the file: the agent passes True on global rank 0
            only; False for a reader such as the supervisor.
        clock: wall-clock seconds for the entries' ``time``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        writer: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.writer = writer
        self._clock = clock
        self.lr_scale = 1.0
        """The factor every rollback's back-off has left on the learning rate."""
        self.skipped = SkipRanges()
        """Batch index ranges ``[start, stop)`` never to be consumed (shared with the batches)."""
        self.entries: list[dict[str, Any]] = []
        """Every event, oldest first."""
        self._lock = threading.RLock()
        self.job_id: str | None = None
        """The job the folder belongs to (``jobid.job_identity``), written with the next event;
        None in a ledger older than job ids, or of a job without one."""
        self.trust_from = 0
        """The first entry from which the ledger records which checkpoints earned trust: a
        ledger written before trust records has none, and its earlier checkpoints count as
        trusted, as they did then (the run went on past them)."""

    def load(self) -> Ledger:
        """Read the file (a missing one is a fresh ledger) and return this ledger.

        Raises:
            LedgerError: the file is not valid JSON or not a ledger; it is left as it is.
        """
        if not self.path.exists():
            return self
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as e:
            raise self._corrupt(f"{type(e).__name__}: {e}") from None
        return self.parse(text)

    def parse(self, text: str | None) -> Ledger:
        """Take the ledger file's text (None: there is no file yet, a fresh ledger) and return
        this ledger: what ``load`` reads, for a reader given the text by another rank.

        Raises:
            LedgerError: the text is not valid JSON or not a ledger.
        """
        if text is None:
            return self
        try:
            document = json.loads(text)
        except ValueError as e:
            raise self._corrupt(f"{type(e).__name__}: {e}") from None
        self._check(document)
        self.lr_scale = float(document["lr_scale"])
        self.skipped = SkipRanges(document["skipped"])
        self.entries = document["entries"]
        job_id = document.get("job_id")
        self.job_id = job_id if isinstance(job_id, str) and job_id else None
        trust_from = document.get("trust_from")
        self.trust_from = (
            trust_from
            if type(trust_from) is int and 0 <= trust_from <= len(self.entries)
            else len(self.entries)
        )
        return self

    @property
    def last_checkpoint(self) -> dict[str, Any] | None:
        """The newest ``checkpoint`` entry, or None."""
        return next((e for e in reversed(self.entries) if e["event"] == "checkpoint"), None)

    def checkpoint_names(self) -> set[str]:
        """The folder names of every checkpoint this ledger recorded: the only ones a load may
        take (a folder it never recorded is not this job's save)."""
        return {Path(e["path"]).name for e in self.entries if e["event"] == "checkpoint"}

    def distrusted(self) -> dict[str, str]:
        """``{folder name: why}`` of the checkpoints never to be loaded again: distrusted
        since they were last recorded (a later save of the same step is trusted afresh)."""
        with self._lock:
            out: dict[str, str] = {}
            for e in self.entries:
                if e["event"] == "checkpoint":
                    out.pop(Path(e["path"]).name, None)
                elif e["event"] == "distrust":
                    out[Path(e["path"]).name] = e["reason"]
            return out

    def trusted(self) -> dict[str, dict[str, Any]]:
        """``{folder name: why}`` of the checkpoints that earned trust since they were last
        recorded and were not distrusted since: their ``trust`` entry (the step through which
        the steps after it were clean, its state's fingerprint), or, for a checkpoint recorded
        before the ledger recorded trust (``trust_from``), ``{"before_trust_records": True}``."""
        with self._lock:
            out: dict[str, dict[str, Any]] = {}
            for i, e in enumerate(self.entries):
                if "path" not in e:
                    continue
                name = Path(e["path"]).name
                if e["event"] == "checkpoint":
                    out.pop(name, None)
                    if i < self.trust_from:
                        out[name] = {"before_trust_records": True}
                elif e["event"] == "trust":
                    out[name] = e
                elif e["event"] == "distrust":
                    out.pop(name, None)
            return out

    def is_skipped(self, index: int) -> bool:
        """Whether batch ``index`` lies in a skipped range."""
        return index in self.skipped

    def record_checkpoint(self, step: int, path: str | os.PathLike) -> None:
        """A healthy checkpoint of ``step`` was committed at ``path``; recording it again (the
        store records it just before its commit, the watchdog once it settled) is a no-op."""
        with self._lock:
            last = self.last_checkpoint
            if (
                last is not None
                and last["step"] == step
                and last["path"] == str(path)
                and not any(
                    e["event"] != "checkpoint" for e in self.entries[self.entries.index(last) :]
                )
            ):
                return
            self._append({"event": "checkpoint", "step": step, "path": str(path)})

    def record_rollback(
        self,
        step: int,
        *,
        to_step: int,
        reason: str,
        lr_scale: float,
        skipped: tuple[int, int] | None,
        positions: tuple[int, int, int] | None = None,
        repeat_of: int | None = None,
    ) -> None:
        """Every rank went back from ``step`` to the checkpoint of ``to_step``.

        Args:
            step: the step whose verdict caused it.
            to_step: the checkpoint's step.
            reason: why, for a person reading the ledger.
            lr_scale: the learning-rate scale from now on (the cumulative back-off).
            skipped: the batch indices ``[start, stop)`` that will never be consumed; None when
                the loop draws its own batches (its RNGs were re-seeded instead).
            positions: ``(checkpoint's data position, position at the rollback, margin)``, the
                numbers ``skipped`` was made of: a restart checks the range against them.
            repeat_of: the step of the earlier rollback this one repeats (it did not cure).
        """
        if skipped is not None and not 0 <= skipped[0] < skipped[1]:
            raise ValueError(f"need 0 <= start < stop, got {skipped}")
        if not (math.isfinite(lr_scale) and 0 < lr_scale <= 1):
            raise ValueError(f"need 0 < lr_scale <= 1, got {lr_scale}")
        self.lr_scale = float(lr_scale)
        if skipped is not None:
            self.skipped.add(*skipped)
        entry = {
            "event": "rollback",
            "step": step,
            "to_step": to_step,
            "reason": reason,
            "lr_scale": self.lr_scale,
            "skipped": list(skipped) if skipped else None,
        }
        if positions is not None:
            entry.update(from_position=positions[0], position=positions[1], margin=positions[2])
        if repeat_of is not None:
            entry["repeat_of"] = repeat_of
        self._append(entry)

    def record_adopted(
        self, step: int, *, source: str, lr_scale: float, skipped: Iterable[tuple[int, int]]
    ) -> None:
        """The run resumed at ``step`` from a checkpoint this folder did not write (a
        framework's own, ``source``) that carried a back-off or skipped batches the ledger
        lacked: from now on ``lr_scale``, and ``skipped`` is never consumed either.

        Args:
            step: the step resumed at.
            source: where the state came from, for a person reading the ledger.
            lr_scale: the learning-rate scale from now on, in (0, 1].
            skipped: the ranges ``[start, stop)`` new to this ledger (each non-empty).
        """
        ranges = [(int(a), int(b)) for a, b in skipped]
        if not all(0 <= a < b for a, b in ranges):
            raise ValueError(f"need 0 <= start < stop, got {ranges}")
        if not _scale_ok(lr_scale):
            raise ValueError(f"need 0 < lr_scale <= 1, got {lr_scale}")
        self.lr_scale = float(lr_scale)
        for rng in ranges:
            self.skipped.add(*rng)
        self._append(
            {
                "event": "adopt",
                "step": step,
                "source": source,
                "lr_scale": self.lr_scale,
                "skipped": [list(r) for r in ranges],
            }
        )

    def record_distrust(self, step: int, path: str | os.PathLike, reason: str) -> None:
        """The checkpoint of ``step`` at ``path`` must never be a rollback's or a restart's
        target again (``reason``: the unhealthy step that followed it, the rollback to it that
        did not cure, the rollback that went back past it)."""
        self._append({"event": "distrust", "step": step, "path": str(path), "reason": reason})

    def record_trust(
        self,
        step: int,
        path: str | os.PathLike,
        *,
        clean_through: int,
        fingerprint: str | None = None,
    ) -> None:
        """The checkpoint of ``step`` at ``path`` earned trust: the steps after it through
        ``clean_through`` passed without an unhealthy verdict (``trust_steps``); ``fingerprint``:
        a checksum of the state it holds (``measure.fingerprint.state_fingerprint`` of global
        rank 0's parameters, hex), which each rank checks its own restore against."""
        entry: dict[str, Any] = {
            "event": "trust",
            "step": step,
            "path": str(path),
            "clean_through": clean_through,
        }
        if fingerprint is not None:
            entry["fingerprint"] = fingerprint
        self._append(entry)

    def record_ramp(self, step: int, lr_scale: float) -> None:
        """The learning-rate scale came back to ``lr_scale`` at ``step`` (``lr_ramp_steps``:
        the end of a ramp after a rollback that cured): a restart resumes with it."""
        if not _scale_ok(lr_scale):
            raise ValueError(f"need 0 < lr_scale <= 1, got {lr_scale}")
        self.lr_scale = float(lr_scale)
        self._append({"event": "ramp", "step": step, "lr_scale": self.lr_scale})

    def record_abort(self, step: int, reason: str) -> None:
        """The job gave up at ``step`` (the loop guard, or a fault recovery cannot fix)."""
        self._append({"event": "abort", "step": step, "reason": reason})

    def to_dict(self) -> dict[str, Any]:
        document = {
            "version": SCHEMA_VERSION,
            "lr_scale": self.lr_scale,
            "skipped": [list(r) for r in self.skipped],
            "entries": self.entries,
        }
        if self.job_id is not None:
            document["job_id"] = self.job_id
        document["trust_from"] = self.trust_from
        return document

    def _append(self, entry: dict[str, Any]) -> None:
        # A background checkpoint commits from its writer thread; the training thread records
        # rollbacks: one document, written by one of them at a time.
        with self._lock:
            self.entries.append({**entry, "time": self._clock()})
            if self.writer:
                self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_json(self.path, self.to_dict(), indent=1)

    def _check(self, document: Any) -> None:
        """Types first, then sense: every value a restart acts on is one a run could have
        written (a learning-rate scale in (0, 1], skips that the rollbacks made, steps that
        the checkpoints hold)."""
        version = document.get("version") if isinstance(document, dict) else None
        if isinstance(version, int) and version > SCHEMA_VERSION:
            try:
                check_version(version, f"ledger {self.path}")
            except RecordVersionError as exc:
                raise LedgerError(f"{exc}; refusing to start over from an empty ledger") from None
        if version != SCHEMA_VERSION:
            raise self._corrupt(f"not a version-{SCHEMA_VERSION} ledger document")
        scale = document.get("lr_scale")
        if not _scale_ok(scale):
            raise self._corrupt(
                f"lr_scale {scale!r} is not in (0, 1]: each rollback multiplies "
                "it by lr_backoff <= 1, from 1"
            )
        skipped = document.get("skipped")
        if not isinstance(skipped, list) or not all(
            isinstance(r, list)
            and len(r) == 2
            and all(type(i) is int for i in r)
            and 0 <= r[0] < r[1]
            for r in skipped
        ):
            raise self._corrupt(f"skipped {skipped!r} is not a list of [start, stop] batch ranges")
        entries = document.get("entries")
        if not isinstance(entries, list):
            raise self._corrupt("entries is not a list")
        for i, entry in enumerate(entries):
            event = entry.get("event") if isinstance(entry, dict) else None
            fields = _FIELDS.get(event) if isinstance(event, str) else None
            if fields is None:
                raise self._corrupt(
                    f"entry {i} is not a checkpoint, rollback, adopt, distrust, trust, ramp or "
                    "abort event"
                )
            for key, types in fields.items():
                if not isinstance(entry.get(key), types) or isinstance(entry.get(key), bool):
                    raise self._corrupt(f"entry {i} ({entry['event']}) has no valid {key!r}")
        self._check_sense(document["entries"], skipped)

    def _check_sense(self, entries: list[dict[str, Any]], skipped: list[list[int]]) -> None:
        saved: set[int] = set()
        made: list[list[int]] = []
        for i, e in enumerate(entries):
            where = f"entry {i} ({e['event']})"
            if e["step"] < 0:
                raise self._corrupt(f"{where}: step {e['step']} is negative")
            if e["event"] == "checkpoint":
                if Path(e["path"]).name != f"step-{e['step']:08d}":
                    raise self._corrupt(
                        f"{where}: path {e['path']!r} is not the folder of step {e['step']}"
                    )
                saved.add(e["step"])
            elif e["event"] == "ramp":
                if not _scale_ok(e["lr_scale"]):
                    raise self._corrupt(f"{where}: lr_scale {e['lr_scale']!r} is not in (0, 1]")
            elif e["event"] in ("distrust", "trust"):
                if e["step"] not in saved or Path(e["path"]).name != f"step-{e['step']:08d}":
                    raise self._corrupt(
                        f"{where}: {e['path']!r} is not a checkpoint of step {e['step']} "
                        "recorded before it"
                    )
                if e["event"] == "trust" and e["clean_through"] <= e["step"]:
                    raise self._corrupt(
                        f"{where}: clean_through {e['clean_through']} is not after step "
                        f"{e['step']}: trust is earned by the steps after a checkpoint"
                    )
            elif e["event"] == "adopt":
                if not _scale_ok(e["lr_scale"]):
                    raise self._corrupt(f"{where}: lr_scale {e['lr_scale']!r} is not in (0, 1]")
                for rng in e["skipped"]:
                    if not (
                        isinstance(rng, list)
                        and len(rng) == 2
                        and all(type(x) is int for x in rng)
                        and 0 <= rng[0] < rng[1]
                    ):
                        raise self._corrupt(
                            f"{where}: skipped {rng!r} is not a [start, stop) batch range"
                        )
                    made.append(list(rng))
            elif e["event"] == "rollback":
                if not _scale_ok(e["lr_scale"]):
                    raise self._corrupt(f"{where}: lr_scale {e['lr_scale']!r} is not in (0, 1]")
                if e["to_step"] not in saved or e["to_step"] > e["step"]:
                    raise self._corrupt(
                        f"{where}: to_step {e['to_step']} is not a checkpoint "
                        f"recorded before it, at or before step {e['step']}"
                    )
                rng = e["skipped"]
                if rng is not None:
                    if not (
                        len(rng) == 2 and all(type(x) is int for x in rng) and 0 <= rng[0] < rng[1]
                    ):
                        raise self._corrupt(
                            f"{where}: skipped {rng!r} is not a [start, stop) batch range"
                        )
                    made.append(list(rng))
                    start, position, margin = (
                        e.get(k) for k in ("from_position", "position", "margin")
                    )
                    if (
                        type(start) is int
                        and type(position) is int
                        and type(margin) is int
                        and rng != [start, position + margin]
                    ):
                        raise self._corrupt(
                            f"{where}: skipped {rng} is not what the rollback made of its "
                            f"positions, [from_position {start}, position {position} + "
                            f"margin {margin})"
                        )
        if sorted(made) != sorted(skipped):
            raise self._corrupt(
                f"skipped {skipped!r} is not the ranges its rollbacks skipped "
                f"({sorted(made)!r}): a range no rollback (or adopted "
                f"checkpoint) made would drop "
                "batches without a word"
            )

    def _corrupt(self, why: str) -> LedgerError:
        return LedgerError(
            f"ledger {self.path} is corrupt ({why}); refusing to start over from an "
            "empty ledger, which would forget the skipped batches and the LR back-off: "
            "repair or remove the file"
        )
