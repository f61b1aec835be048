"""Unit tests for the backtest's TensorBoard reader, on event files torch's ``SummaryWriter``
writes: python -m pytest tests/unit/test_backtest_tensorboard.py"""

from __future__ import annotations

import math
import os
import socket
import struct

import pytest
from tensorboard.plugins.scalar import summary_v2
from torch.utils.tensorboard import SummaryWriter

from torchvitals.agent.tools.backtest.logs import LogError, LogPoint, read_logs


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch):
    """Writing and reading event files must stay on the filesystem."""

    def refuse(*args, **kwargs):
        raise AssertionError("a socket was opened")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def write_run(folder, scalars: dict[str, list[tuple[int, float]]], name: str | None = None) -> str:
    """One event file in ``folder`` holding ``scalars`` (tag -> (step, value) in order); renamed
    to ``name`` when given. Returns its path."""
    writer = SummaryWriter(str(folder))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()
    (path,) = [os.path.join(folder, f) for f in os.listdir(folder) if "tfevents" in f]
    if name is not None:
        os.rename(path, os.path.join(folder, name))
        path = os.path.join(folder, name)
    return path


def test_scalars_from_a_file_and_from_its_folder(tmp_path):
    path = write_run(
        tmp_path / "runs",
        {
            "train/loss": [(1, 2.5), (2, 1.25), (3, math.nan)],
            "train/grad_norm": [(1, 0.5), (2, 0.25), (3, math.inf)],
            "train/learning_rate": [(1, 0.125), (2, 0.125)],
            "val/acc": [(1, 0.5)],
        },
    )
    for source in (path, str(tmp_path / "runs")):
        series = read_logs([source])
        assert series.points[:2] == [LogPoint(1, 2.5, 0.5, 0.125), LogPoint(2, 1.25, 0.25, 0.125)]
        assert math.isnan(series.points[2].loss) and series.points[2].grad_norm == math.inf
        assert series.files == [path] and series.columns == {"loss", "grad_norm", "lr"}
        assert series.notes == []


def test_megatron_tags_and_tf2_tensor_scalars(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    for step in (10, 20):
        writer.add_scalar("grad-norm", 1.5, step)
        writer.add_scalar("learning-rate", 0.25, step)
        # tf.summary.scalar's form: a tensor for the scalars plugin, no simple_value.
        writer.file_writer.add_summary(summary_v2.scalar_pb("lm loss", 6.5 - step / 10), step)
    writer.close()
    series = read_logs([str(tmp_path)], format="tensorboard")
    assert series.points == [LogPoint(10, 5.5, 1.5, 0.25), LogPoint(20, 4.5, 1.5, 0.25)]


def test_a_restart_in_one_file_and_a_resumed_file_in_the_folder(tmp_path):
    runs = tmp_path / "runs"
    restarted = {"loss": [(1, 9.0), (2, 9.0), (3, 9.0), (2, 8.0), (3, 8.0), (4, 8.0)]}
    first = write_run(runs, restarted, name="events.out.tfevents.100.host")
    # The resumed run's file sorts after the first by name (the time it was opened).
    second = write_run(
        runs / "resumed", {"loss": [(4, 1.0), (5, 1.0)]}, "events.out.tfevents.200.h"
    )
    series = read_logs([str(runs)])
    assert [(p.step, p.loss) for p in series.points] == [
        (1, 9.0),
        (2, 8.0),
        (3, 8.0),
        (4, 1.0),
        (5, 1.0),
    ]
    assert series.files == [first, second]
    assert series.notes == [
        f"{first}: steps 2-3 logged again later in the file (a restart?): the later steps "
        "replace them",
        f"{second} replaced steps 4 of {first}",
    ]


def test_an_event_file_without_a_loss_names_its_tags(tmp_path):
    path = write_run(tmp_path / "a", {"val/acc": [(1, 0.5)], "epoch": [(1, 1.0)]})
    with pytest.raises(LogError) as info:
        read_logs([path])
    assert str(info.value).startswith(f"{path}: no loss tag (looked for loss, train/loss")
    assert str(info.value).endswith("scalar tags: epoch, val/acc")


def test_a_folder_skips_an_event_file_without_a_loss_but_says_so(tmp_path):
    write_run(tmp_path / "runs", {"loss": [(1, 2.0)]}, name="events.out.tfevents.1.host")
    hparams = write_run(tmp_path / "runs" / "hp", {"acc": [(1, 0.5)]}, "events.out.tfevents.2.h")
    series = read_logs([str(tmp_path / "runs")])
    assert series.points == [LogPoint(1, 2.0)]
    assert series.notes == [
        f"{tmp_path / 'runs'}: skipped the event files without a loss: {hparams} (no loss tag "
        "(looked for loss, train/loss, train/lm_loss, lm loss, train_loss); scalar tags: acc)"
    ]


def flip_a_data_byte(data: bytes, record: int) -> bytes:
    """``data`` with a byte inside the record's data flipped: its lengths intact, its checksum
    wrong (a record: 8 bytes of length, 4 of their checksum, the data, 4 of its checksum)."""
    at = 0
    for _ in range(record):
        at += struct.unpack_from("<Q", data, at)[0] + 16
    at += 12 + 2
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


def test_a_truncated_or_garbled_event_file_is_an_error(tmp_path):
    """tensorboard itself stops at a cut or garbled record without a word; the reader says."""
    path = write_run(tmp_path / "a", {"loss": [(s, 1.0) for s in range(1, 50)]})
    with open(path, "rb") as f:
        data = f.read()
    for name, content, problem in [
        ("cut", data[:-7], "a truncated or corrupt event file"),
        ("junk", os.urandom(4000), "a truncated or corrupt event file"),
        ("mid", data[:500] + b"\xff" * 12 + data[512:], "a truncated or corrupt event file"),
        ("empty", b"", "empty file"),
        ("crc", flip_a_data_byte(data, record=10), "a corrupt event file: tensorboard stopped"),
    ]:
        bad = tmp_path / f"events.out.tfevents.{name}"
        bad.write_bytes(content)
        with pytest.raises(LogError, match=f"^{bad}: {problem}"):
            read_logs([str(bad)])


def test_a_folder_without_event_files_and_a_missing_path(tmp_path):
    with pytest.raises(LogError, match="a folder without TensorBoard event files"):
        read_logs([str(tmp_path)], format="tensorboard")
    with pytest.raises(LogError, match="no such file or folder"):
        read_logs([str(tmp_path / "nope")], format="tensorboard")
