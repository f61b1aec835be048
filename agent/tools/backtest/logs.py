"""A past run's per-step log read into one series of steps: what ``torchvitals backtest`` replays.

    series = read_logs(["run.csv", "resumed.csv.gz"])       # pieces of one run, in order
    [(p.step, p.loss, p.grad_norm, p.lr) for p in series.points]   # sorted, one per step
    series.notes          # ["resumed.csv.gz replaced steps 900-1000 of run.csv", ...]

The formats (``FORMATS``; ``auto`` tells them by the name, else by the first line):

- CSV or TSV with a header naming a step and a loss column (``STEP_NAMES``, ``LOSS_NAMES``,
  ``GRAD_NORM_NAMES``, ``LR_NAMES``, any case), Weights & Biases exports
  (``<run> - train/loss``) included;
- JSON lines with the same keys, torchvitals' own ``events.jsonl`` included (its step reports:
  ``grad_norm_total``, the first param group's ``lr``);
- Megatron-LM's ``iteration 100/ 500000 | ... | lm loss: ... |`` lines, among any others;
- TensorBoard event files, or a folder of them (read with the ``tensorboard`` package).

Any file may be gzipped, whatever its name. Several files are pieces of one resumed run: where
their steps overlap the later piece wins, as a later line wins within one file (a restart); both
are told in ``Series.notes``. Every problem with a file is a ``LogError`` naming it. Imports no
torch.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ....errors import ConfigError
from .eventfiles import read_tensorboard
from .series import (
    EVENT_FILE,
    GRAD_NORM_NAMES,
    LOSS_NAMES,
    LR_NAMES,
    STEP_NAMES,
    LogError,
    LogPoint,
    Piece,
    Series,
    few,
)

__all__ = ["FORMATS", "LogError", "LogPoint", "Series", "read_logs", "read_records"]

FORMATS = ("auto", "csv", "tsv", "jsonl", "tensorboard", "megatron")

_EXTENSIONS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".log": "megatron",
    ".txt": "megatron",
    ".out": "megatron",
}
_GZIP_MAGIC = b"\x1f\x8b"
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*(\|[^\n]*)")
"""A Megatron-LM iteration line after any prefix (a time, ``[default0]:``): its step, its fields."""
_MEGATRON_FIELD = re.compile(r"\|\s*(lm loss|loss|grad norm|learning rate)\s*:([^|]*)")
"""The fields read from it: the loss (``lm loss``, else ``loss``), ``grad norm``, ``learning
rate``; an iteration skipped for an fp16 overflow prints neither loss nor grad norm."""


def read_logs(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], format: str = "auto"
) -> Series:
    """Read the logs of one run into a series.

    Args:
        paths: the files (or TensorBoard folders) in order: pieces of one run, a later piece
            winning where steps overlap. A single path is taken as a list of one.
        format: one of ``FORMATS``; ``auto`` tells each file's format by its name, else by its
            first line.

    Returns:
        The Series.

    Raises:
        LogError: a file is missing, empty, unreadable, in no format it can tell, garbled (the
            line named), or has no loss.
        ConfigError: ``format`` is not one of ``FORMATS``, or ``paths`` is empty.
    """
    if format not in FORMATS:
        raise ConfigError("format", format, f"one of {', '.join(FORMATS)}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ConfigError("paths", list(paths), "at least one log file")
    pieces: list[Piece] = []
    for path in paths:
        pieces += _read_path(os.fspath(path), format)
    return _merge(pieces)


def read_records(records: Iterable[Mapping[str, Any]], name: str = "<records>") -> Series:
    """A series from dicts with the keys of a JSON-lines log (``{"step": 3, "loss": 2.1}``).

    Args:
        records: one mapping per step, in the order logged (a later one replaces an earlier
            one of the same step); those whose ``"event"`` is not ``"step"`` are skipped.
        name: what the errors and notes call the records.

    Returns:
        The Series.

    Raises:
        LogError: a record is not a mapping or holds a value that is not a number, or none
            has a loss.
    """
    reader = _JsonReader(Piece(name, "records"))
    for number, record in enumerate(records, 1):
        reader.add(record, f"record {number}")
    return _merge([reader.finish()])


def _read_path(path: str, format: str) -> list[Piece]:
    kind = _by_name(path) if format == "auto" else format
    if kind == "tensorboard":
        return read_tensorboard(path)
    if os.path.isdir(path):
        raise LogError(path, f"a folder, and it holds no TensorBoard event files ({EVENT_FILE}.*)")
    data = _load(path)
    kind = kind or _sniff(path, data)
    if kind == "megatron":
        return [_read_megatron(path, data.decode("utf-8", "replace"))]
    if kind == "jsonl":
        return [_read_jsonl(path, _decode(path, data))]
    return [_read_delimited(path, _decode(path, data), "\t" if kind == "tsv" else ",")]


def _by_name(path: str) -> str | None:
    name = os.path.basename(path).lower().removesuffix(".gz")
    if EVENT_FILE in name or os.path.isdir(path):
        return "tensorboard"
    return _EXTENSIONS.get(os.path.splitext(name)[1])


def _sniff(path: str, data: bytes) -> str:
    head = data[:65536].decode("utf-8", "replace")
    first = next((line.strip() for line in head.split("\n") if line.strip()), "")
    if first.startswith("{"):
        return "jsonl"
    if _ITERATION.search(first):
        return "megatron"
    if "\t" in first:
        return "tsv"
    if "," in first:
        return "csv"
    if _ITERATION.search(data.decode("utf-8", "replace")):
        return "megatron"
    raise LogError(
        path,
        "cannot tell its format: neither its name nor its first line is one of JSON lines, "
        "Megatron iteration lines, TSV or CSV; pass --format",
    )


def _load(path: str) -> bytes:
    """The file's bytes, gunzipped when they start with gzip's magic bytes."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise LogError(path, "no such file") from None
    except OSError as exc:
        raise LogError(path, f"cannot be read: {exc.strerror or exc}") from None
    if data.startswith(_GZIP_MAGIC):
        try:
            data = gzip.decompress(data)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise LogError(path, f"a truncated or corrupt gzip file ({exc})") from None
    if not data or data.isspace():  # isspace stops at the first other byte; strip would copy
        raise LogError(path, "empty file")
    return data


def _decode(path: str, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")  # -sig: a spreadsheet's byte-order mark is no column name
    except UnicodeDecodeError as exc:
        raise LogError(path, f"not UTF-8 text at byte {exc.start} (a binary file?)") from None


# ---------------------------------------------------------------- CSV and TSV


def _read_delimited(path: str, text: str, delimiter: str) -> Piece:
    piece = Piece(path, "rows")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = next((row for row in reader if row), None)
        if header is None:
            raise LogError(path, "empty file")
        si, li, gi, ri = columns = _columns(piece, header)
        width, points, again = len(header), piece.points, piece.again
        for row in reader:
            if len(row) != width:
                if not row:
                    continue
                raise LogError(
                    path, f"line {reader.line_num}: {len(row)} fields, the header has {width}"
                )
            try:
                step = int(row[si])
                loss = float(c) if (c := row[li]) else None
                grad = float(c) if gi is not None and (c := row[gi]) else None
                lr = float(c) if ri is not None and (c := row[ri]) else None
                point = LogPoint(step, loss, grad, lr)
            except ValueError:  # a blank or spaced cell, a step written 100.0, or a bad number
                point = _careful_row(path, reader.line_num, header, row, columns)
            if point.step in points:
                again.append(point.step)
            points[point.step] = point
    except csv.Error as exc:
        raise LogError(path, f"line {reader.line_num}: {exc}") from None
    return piece


def _column_key(name: str) -> str | None:
    """The name to match: W&B's ``<run> - train/loss`` as ``train/loss``; its ``__MIN`` and
    ``__MAX`` companions not at all."""
    key = name.strip().lower()
    return None if key.endswith(("__min", "__max")) else key.rpartition(" - ")[2].strip()


def _columns(piece: Piece, header: list[str]) -> tuple[int, int, int | None, int | None]:
    keys = [_column_key(name) for name in header]

    def pick(names: Sequence[str]) -> int | None:
        for name in names:
            at = [i for i, key in enumerate(keys) if key == name]
            if len(at) > 1:
                piece.notes.append(
                    f"{piece.name}: {len(at)} columns are {name} "
                    f"({', '.join(header[i] for i in at)}): read the first"
                )
            if at:
                return at[0]
        return None

    step, loss = pick(STEP_NAMES), pick(LOSS_NAMES)
    for index, what, names in ((step, "step", STEP_NAMES), (loss, "loss", LOSS_NAMES)):
        if index is None:
            raise LogError(
                piece.name,
                f"no {what} column (looked for {', '.join(names)}); columns: {few(header, 20)}",
            )
    assert step is not None and loss is not None
    return step, loss, pick(GRAD_NORM_NAMES), pick(LR_NAMES)


def _careful_row(
    path: str,
    line: int,
    header: list[str],
    row: list[str],
    columns: tuple[int, int, int | None, int | None],
) -> LogPoint:
    """The row's point, or the LogError that names its bad cell."""
    values: list[float | None] = []
    for i in columns:
        if i is None:
            values.append(None)
            continue
        cell = row[i].strip()
        try:
            values.append(float(cell) if cell else None)
        except ValueError:
            raise LogError(path, f"line {line}: {header[i]!r} is {cell!r}, not a number") from None
    step = values[0]
    if step is None or not step.is_integer():
        raise LogError(path, f"line {line}: the step is {row[columns[0]]!r}, not a whole number")
    return LogPoint(int(step), *values[1:])


# ---------------------------------------------------------------- JSON lines


def _read_jsonl(path: str, text: str) -> Piece:
    reader = _JsonReader(Piece(path, "lines"))
    lines = text.split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            cut = "; the last line, cut short?" if number == len(lines) else ""
            raise LogError(path, f"line {number}: not JSON ({exc.msg}{cut})") from None
        reader.add(obj, f"line {number}")
    return reader.finish()


class _JsonReader:
    """Collects the points of JSON objects: a key set's columns are looked up once."""

    def __init__(self, piece: Piece) -> None:
        self.piece = piece
        self.keys: dict[tuple[Any, ...], tuple[str | None, ...]] = {}
        self.other_events: Counter[str] = Counter()
        self.without_step: list[str] = []

    def add(self, obj: Any, where: str) -> None:
        if type(obj) is not dict and not isinstance(obj, Mapping):
            raise LogError(self.piece.name, f"{where}: not an object but {type(obj).__name__}")
        kind = obj.get("event", "step")  # torchvitals' events.jsonl: step reports and others
        if kind != "step":
            self.other_events[str(kind)] += 1
            return
        shape = tuple(obj)
        if (keys := self.keys.get(shape)) is None:
            keys = self.keys[shape] = _json_keys(shape)
        step_key, loss_key, grad_key, lr_key = keys
        if step_key is None:
            self.without_step.append(where)
            return
        try:
            step = _whole(obj[step_key])
            loss = _json_float(obj[loss_key]) if loss_key else None
            grad = obj[grad_key] if grad_key else None
            grad = None if isinstance(grad, (dict, Mapping)) else _json_float(grad)  # per block
            lr = obj[lr_key] if lr_key else None
            lr = _json_float(lr[0] if lr else None) if isinstance(lr, list) else _json_float(lr)
        except (TypeError, ValueError) as exc:
            raise LogError(self.piece.name, f"{where}: {exc}") from None
        # torchvitals writes NaN for a value nobody measured, and says when it was non-finite.
        if _nan(loss) and obj.get("nonfinite_loss") is False:
            loss = None
        if _nan(grad) and obj.get("nonfinite_grad") is False:
            grad = None
        if step in self.piece.points:
            self.piece.again.append(step)
        self.piece.points[step] = LogPoint(step, loss, grad, lr)

    def finish(self) -> Piece:
        name = self.piece.name
        if self.other_events:
            kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.other_events.items()))
            self.piece.notes.append(f"{name}: skipped the events that are no step ({kinds})")
        if self.without_step:
            self.piece.notes.append(
                f"{name}: skipped {len(self.without_step)} without a step "
                f"(looked for {', '.join(STEP_NAMES)}): {few(self.without_step)}"
            )
        if self.piece.points and not any(k[1] for k in self.keys.values()):
            keys = sorted({str(k) for shape in self.keys for k in shape})
            raise LogError(
                name, f"no loss (looked for {', '.join(LOSS_NAMES)}); keys: {few(keys, 20)}"
            )
        if not self.piece.points:
            raise LogError(name, f"no step (looked for {', '.join(STEP_NAMES)})")
        return self.piece


def _json_keys(shape: tuple[Any, ...]) -> tuple[str | None, ...]:
    """The keys of ``shape`` that hold the step, the loss, the grad norm and the learning rate:
    torchvitals' ``grad_norm_total`` before any ``grad_norm`` (its per-block dict). A list of
    learning rates (torchvitals' per param group) is read as its first."""
    lower: dict[str, str] = {}
    for key in shape:
        lower.setdefault(str(key).lower(), key)
    names = (STEP_NAMES, LOSS_NAMES, ("grad_norm_total", *GRAD_NORM_NAMES), LR_NAMES)
    return tuple(next((lower[n] for n in wanted if n in lower), None) for wanted in names)


def _json_float(value: Any) -> float | None:
    """A number as JSON holds it: null, a number, or a string ("nan", "inf" as torchvitals
    writes them)."""
    if type(value) is float:  # the common case first: a log holds a number per line
        return value
    if value is None or value == "":
        return None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError(f"{value!r} is not a number")


def _is_number(text: str) -> bool:
    try:
        float(text or 0)
    except ValueError:
        return False
    return True


def _nan(value: float | None) -> bool:
    return value is not None and math.isnan(value)


def _whole(value: Any) -> int:
    number = _json_float(value)
    if number is None or not number.is_integer():
        raise ValueError(f"the step is {value!r}, not a whole number")
    return int(number)


# ---------------------------------------------------------------- Megatron


def _read_megatron(path: str, text: str) -> Piece:
    piece = Piece(path, "iterations")
    points, again = piece.points, piece.again
    for match in _ITERATION.finditer(text):
        fields: dict[str, str] = dict(_MEGATRON_FIELD.findall(match.group(2)))
        cells = (
            fields.get("lm loss", fields.get("loss", "")),
            fields.get("grad norm", ""),
            fields.get("learning rate", ""),
        )
        try:
            values = [float(cell) if cell.strip() else None for cell in cells]
        except ValueError:
            line = text.count("\n", 0, match.start()) + 1
            bad = next(c.strip() for c in cells if not _is_number(c))
            raise LogError(path, f"line {line}: {bad!r} is not a number") from None
        step = int(match.group(1))
        if step in points:
            again.append(step)
        points[step] = LogPoint(step, *values)
    if not points:
        raise LogError(path, "no Megatron iteration line (iteration N/ M | ... | lm loss: ... |)")
    return piece


# ---------------------------------------------------------------- the pieces as one series


def _merge(pieces: list[Piece]) -> Series:
    """One series from the pieces in order: a later piece replaces every earlier step within
    its own range of steps (a run resumed from an earlier checkpoint: what the first attempt
    logged past that point never reached the weights, whether or not the second logged the
    same steps)."""
    merged: dict[int, LogPoint] = {}
    owner: dict[int, int] = {}
    notes: list[str] = []
    for i, piece in enumerate(pieces):
        notes += piece.notes + _piece_notes(piece)
        replaced: dict[int, set[int]] = {}
        first, last = min(piece.points), max(piece.points)
        for step in [s for s in owner if first <= s <= last]:
            replaced.setdefault(owner.pop(step), set()).add(step)
            del merged[step]
        for j, steps in sorted(replaced.items()):
            earlier = pieces[j]
            notes.append(
                f"{piece.name} replaced steps {_spans(sorted(earlier.points), steps)} of "
                f"{earlier.name}"
            )
        merged.update(piece.points)
        owner.update(dict.fromkeys(piece.points, i))
    points = [merged[step] for step in sorted(merged)]
    columns = {
        name
        for name, present in (
            ("loss", any(p.loss is not None for p in points)),
            ("grad_norm", any(p.grad_norm is not None for p in points)),
            ("lr", any(p.lr is not None for p in points)),
        )
        if present
    }
    return Series(points, [p.name for p in pieces], columns, notes)


def _piece_notes(piece: Piece) -> list[str]:
    """What a reader should know of one file: steps logged twice, steps without a loss. A file
    without any loss is a LogError."""
    steps = sorted(piece.points)
    notes = []
    if piece.again:
        notes.append(
            f"{piece.name}: steps {_spans(steps, set(piece.again))} logged again later in the "
            f"file (a restart?): the later {piece.unit} replace them"
        )
    missing = [s for s in steps if piece.points[s].loss is None]
    if len(missing) == len(steps):
        raise LogError(piece.name, f"no loss in any of its {_count(len(steps), piece.unit)}")
    if missing:
        notes.append(
            f"{piece.name}: {_count(len(missing), piece.unit)} without a loss ({few(missing)})"
        )
    return notes


def _spans(steps: list[int], chosen: set[int], most: int = 5) -> str:
    """The chosen steps as runs of neighbours in ``steps`` (sorted): ``900-1000, 1200``."""
    spans: list[list[int]] = []
    inside = False
    for step in steps:
        if step in chosen:
            if inside:
                spans[-1][1] = step
            else:
                spans.append([step, step])
            inside = True
        else:
            inside = False
    text = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans[:most])
    return text + (f" and {len(spans) - most} more runs" if len(spans) > most else "")


def _count(n: int, unit: str) -> str:
    """``3 rows``, ``1 row``: ``unit`` is a plural in s."""
    return f"{n} {unit if n != 1 else unit[:-1]}"
