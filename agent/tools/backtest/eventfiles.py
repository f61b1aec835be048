"""TensorBoard event files for ``logs``: read with tensorboard's own reader, checked first.

    read_tensorboard("runs/tb")     # an event file, or a folder of them

tensorboard never raises on a damaged file: it drops a truncated last record, stops at a bad
checksum and gives no tags for junk, so a replay would judge a shortened run without a word.
Here the records are walked first (a record running past the end is a LogError) and the last
one must be among what tensorboard read (a garbled one is a LogError). The package is imported
only when an event file is read; without it, a LogError says how to install it. Torch-free.
"""

from __future__ import annotations

import importlib
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .series import (
    EVENT_FILE,
    GRAD_NORM_NAMES,
    LOSS_NAMES,
    LR_NAMES,
    LogError,
    LogPoint,
    NoLoss,
    Piece,
    few,
)

_RECORD_LENGTH = struct.Struct("<Q")
_NEEDS_TENSORBOARD = (
    "reading TensorBoard event files needs the tensorboard package: pip install tensorboard"
)


def read_tensorboard(path: str) -> list[Piece]:
    """The pieces of an event file, or of every event file in a folder (recursively, in name
    order: the names start with the time each was opened); a file without a loss tag is skipped
    in a folder and an error alone.

    Raises:
        LogError: no such file, no event file in the folder, no loss in any, a truncated or
            garbled file, or no tensorboard package.
    """
    if os.path.isdir(path):
        files = sorted(
            (p for p in Path(path).rglob(f"*{EVENT_FILE}*") if p.is_file()),
            key=lambda p: (p.name, str(p)),  # the names start with the time they were opened
        )
        if not files:
            raise LogError(path, f"a folder without TensorBoard event files ({EVENT_FILE}.*)")
    elif os.path.exists(path):
        files = [Path(path)]
    else:
        raise LogError(path, "no such file or folder")
    pieces: list[Piece] = []
    skipped: list[str] = []
    for file in files:
        try:
            pieces.append(_read_event_file(str(file)))
        except NoLoss as exc:
            if len(files) == 1:
                raise
            skipped.append(f"{exc.path} ({exc.problem})")
    if not pieces:
        raise LogError(path, f"no event file with a loss: {'; '.join(skipped)}")
    if skipped:
        pieces[0].notes.append(
            f"{path}: skipped the event files without a loss: {'; '.join(skipped)}"
        )
    return pieces


def _read_event_file(name: str) -> Piece:
    try:
        accumulator = importlib.import_module(
            "tensorboard.backend.event_processing.event_accumulator"
        )
        tensor_util = importlib.import_module("tensorboard.util.tensor_util")
        event_pb2 = importlib.import_module("tensorboard.compat.proto.event_pb2")
    except ImportError:
        raise LogError(name, _NEEDS_TENSORBOARD) from None
    last = _last_record(name)
    acc = accumulator.EventAccumulator(
        name,
        size_guidance={accumulator.SCALARS: 0, accumulator.TENSORS: 0},
        purge_orphaned_data=False,  # a restart's steps are ours to replace, and to tell
    )
    series: dict[str, list[tuple[int, float]]] = {}
    try:
        acc.Reload()
        tags = acc.Tags()
        for tag in tags["scalars"]:
            series.setdefault(tag.lower(), [(e.step, e.value) for e in acc.Scalars(tag)])
        for tag in tags["tensors"]:  # tf.summary.scalar (TF2) writes tensors for the scalars plugin
            if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars":
                arrays = [
                    (e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)
                ]
                series.setdefault(
                    tag.lower(), [(s, float(a.item())) for s, a in arrays if a.size == 1]
                )
        whole = _read_to_the_end(acc, tags, event_pb2.Event.FromString(last))
    except Exception as exc:  # what tensorboard raises on a garbled record is not documented
        raise LogError(name, f"a corrupt event file ({type(exc).__name__}: {exc})") from None
    if not whole:
        raise LogError(
            name, "a corrupt event file: tensorboard stopped before its last record (a garbled one)"
        )
    wanted = (LOSS_NAMES, GRAD_NORM_NAMES, LR_NAMES)
    chosen = [next((series[n] for n in names if n in series), []) for names in wanted]
    if not chosen[0]:
        shown = few(sorted(series), 20) if series else "none"
        raise NoLoss(
            name, f"no loss tag (looked for {', '.join(LOSS_NAMES)}); scalar tags: {shown}"
        )
    piece = Piece(name, "steps")
    values: dict[int, list[float | None]] = {}
    again: set[int] = set()
    for i, events in enumerate(chosen):
        seen: set[int] = set()
        for step, value in events:
            if step in seen:
                again.add(step)
            seen.add(step)
            values.setdefault(step, [None, None, None])[i] = value
    piece.points = {step: LogPoint(step, *v) for step, v in sorted(values.items())}
    piece.again = sorted(again)
    return piece


def _last_record(name: str) -> bytes:
    """The file's last record, or a LogError when its records do not end where it does:
    tensorboard stops at a truncated record without a word."""
    try:
        with open(name, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise LogError(name, f"cannot be read: {exc.strerror or exc}") from None
    if not data:
        raise LogError(name, "empty file")
    at = start = length = 0
    # A record: its length (8 bytes), their checksum (4), the data, the data's checksum (4).
    while at + 12 <= len(data):
        start = at
        length = _RECORD_LENGTH.unpack_from(data, at)[0]
        at += length + 16
        if at > len(data):
            break
    if at != len(data):
        raise LogError(
            name,
            f"a truncated or corrupt event file: the record at byte {start} runs past its end "
            f"({len(data)} bytes)",
        )
    return data[start + 12 : start + 12 + length]


def _read_to_the_end(acc: Any, tags: Mapping[str, Any], last: Any) -> bool:
    """Whether tensorboard read the file's last event: it stops at a garbled record (a bad
    checksum) without a word. Only a scalar or tensor event can be looked for."""
    if not any(v.HasField("simple_value") or v.HasField("tensor") for v in last.summary.value):
        return True
    ends = [events[-1] for t in tags["scalars"] if (events := acc.Scalars(t))]
    ends += [events[-1] for t in tags["tensors"] if (events := acc.Tensors(t))]
    return any(e.step == last.step and e.wall_time == last.wall_time for e in ends)
