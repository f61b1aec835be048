"""Unit tests for the backtest's log readers (torch-free):
python -m pytest tests/unit/test_backtest_logs.py"""

from __future__ import annotations

import gzip
import json
import math
import sys

import pytest

from torchvitals.agent.outputs.eventlog import EventLog
from torchvitals.agent.report import Report
from torchvitals.agent.tools.backtest.logs import (
    FORMATS,
    LogError,
    LogPoint,
    read_logs,
    read_records,
)
from torchvitals.errors import ConfigError, TorchvitalsError

MEGATRON = (
    "{prefix}iteration {step:8d}/  500000 | consumed samples: {samples} | elapsed time per "
    "iteration (ms): 1234.5 | learning rate: 1.000E-04 | global batch size:   128 | "
    "{loss}loss scale: 65536.0 | {grad}number of skipped iterations:   0 | "
    "number of nan iterations:   0 |"
)


def megatron_line(step: int, loss: float | None = 2.5, grad: float | None = 1.25, prefix="") -> str:
    return MEGATRON.format(
        prefix=prefix,
        step=step,
        samples=step * 128,
        loss="" if loss is None else f"lm loss: {loss:.6E} | ",
        grad="" if grad is None else f"grad norm: {grad} | ",
    )


def write(tmp_path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, str):
        path.write_text(text, encoding="utf-8")
    else:
        path.write_bytes(text)
    return str(path)


def same(a: float | None, b: float | None) -> bool:
    """Equal, NaN equal to NaN."""
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def raises_log_error(path: str, *parts: str, format: str = "auto") -> LogError:
    with pytest.raises(LogError) as info:
        read_logs([path], format)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and "\n" not in text, text
    for part in parts:
        assert part in text, text
    assert info.value.path == path and isinstance(info.value, (TorchvitalsError, ValueError))
    return info.value


# ---------------------------------------------------------------- CSV and TSV


def test_csv_reads_steps_losses_grad_norms_and_learning_rates(tmp_path):
    path = write(
        tmp_path,
        "run.csv",
        "step,loss,grad_norm,lr,acc\n"
        "1,2.5,1.0,1e-4,0.1\n"
        "2,nan,inf,1e-4,0.2\n"
        "3,,1.5,,0.3\n"
        "4,-inf, 2.0 ,1e-4,0.4\n",
    )
    series = read_logs([path])
    assert [p.step for p in series.points] == [1, 2, 3, 4]
    assert series.points[0] == LogPoint(1, 2.5, 1.0, 1e-4)
    assert math.isnan(series.points[1].loss) and series.points[1].grad_norm == math.inf
    assert series.points[2] == LogPoint(3, None, 1.5, None)
    assert series.points[3] == LogPoint(4, -math.inf, 2.0, 1e-4)
    assert series.files == [path] and series.columns == {"loss", "grad_norm", "lr"}
    assert series.notes == [f"{path}: 1 row without a loss (3)"]


def test_tsv_and_case_insensitive_names_in_priority_order(tmp_path):
    path = write(
        tmp_path,
        "run.tsv",
        "Global_Step\tTrain/Loss\tLOSS\tLearning Rate\n3\t9.0\t1.5\t0.1\n1\t9.0\t2.5\t0.1\n",
    )
    series = read_logs([path])
    # "loss" comes before "train/loss" in the list: it wins whatever the header's order.
    assert series.points == [LogPoint(1, 2.5, None, 0.1), LogPoint(3, 1.5, None, 0.1)]
    assert series.columns == {"loss", "lr"}


def test_weights_and_biases_exports(tmp_path):
    path = write(
        tmp_path,
        "wandb_export.csv",
        '"Step","run-7 - train/loss","run-7 - train/loss__MIN","run-7 - train/loss__MAX",'
        '"run-7 - train/grad_norm"\n'
        '"10","2.5","2.4","2.6","0.5"\n'
        '"20","","","","0.4"\n'
        '"30","2.25","2.2","2.3",""\n',
    )
    series = read_logs([path])
    assert series.points == [
        LogPoint(10, 2.5, 0.5),
        LogPoint(20, None, 0.4),
        LogPoint(30, 2.25, None),
    ]
    assert series.notes == [f"{path}: 1 row without a loss (20)"]


def test_a_step_written_as_a_float_is_read(tmp_path):
    path = write(tmp_path, "run.csv", "step,loss\n100.0,1.0\n")
    assert read_logs([path]).points == [LogPoint(100, 1.0)]


def test_a_csv_without_a_loss_column_says_what_it_looked_for(tmp_path):
    path = write(tmp_path, "run.csv", "step,acc\n1,0.5\n")
    raises_log_error(path, "no loss column (looked for loss, train/loss", "columns: step, acc")
    path = write(tmp_path, "nostep.csv", "epoch,loss\n1,0.5\n")
    raises_log_error(path, "no step column (looked for step, _step", "columns: epoch, loss")


def test_a_bad_number_in_a_cell_names_its_line(tmp_path):
    path = write(tmp_path, "run.csv", "step,loss\n1,2.0\n2,oops\n")
    raises_log_error(path, "line 3", "'loss'", "'oops'")
    path = write(tmp_path, "step.csv", "step,loss\n1.5,2.0\n")
    raises_log_error(path, "line 2", "not a whole number")


def test_a_row_with_too_few_fields_or_cut_short_is_an_error(tmp_path):
    path = write(tmp_path, "run.csv", "step,loss,lr\n1,2.0,0.1\n2,2.0\n3,1.0,0.1\n")
    raises_log_error(path, "line 3", "2 fields, the header has 3")
    path = write(tmp_path, "cut.csv", "step,loss,lr\n1,2.0,0.1\n2,1.9")  # the last row cut
    raises_log_error(path, "line 3")


def test_blank_lines_are_skipped(tmp_path):
    path = write(tmp_path, "run.csv", "\nstep,loss\n\n1,2.0\n\n2,1.0\n\n")
    assert [p.loss for p in read_logs([path]).points] == [2.0, 1.0]


# ---------------------------------------------------------------- JSON lines


def test_jsonl_lines_with_the_same_keys(tmp_path):
    lines = [
        {"Step": 1, "train/loss": 2.5, "grad_norm": 1.0, "learning_rate": 0.001},
        {"Step": 2, "train/loss": "nan", "grad_norm": None},
        {"Step": 3, "train/loss": "inf", "grad_norm": 0.5, "learning_rate": "1e-3"},
        {"Step": 4, "acc": 0.5},
    ]
    path = write(tmp_path, "run.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    series = read_logs([path])
    assert series.points[0] == LogPoint(1, 2.5, 1.0, 0.001)
    assert math.isnan(series.points[1].loss) and series.points[1].grad_norm is None
    assert series.points[2] == LogPoint(3, math.inf, 0.5, 0.001)
    assert series.points[3] == LogPoint(4, None)
    assert series.notes == [f"{path}: 1 line without a loss (4)"]


def test_a_truncated_jsonl_line_is_an_error(tmp_path):
    path = write(tmp_path, "run.jsonl", '{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    raises_log_error(path, "line 2: not JSON", "cut short")
    path = write(tmp_path, "mid.jsonl", '{"step": 1, "loss": 2.0}\nnot json\n{"step": 3}\n')
    raises_log_error(path, "line 2: not JSON")
    path = write(tmp_path, "list.jsonl", "[1, 2]\n")
    raises_log_error(path, "line 1: not an object")
    path = write(tmp_path, "value.jsonl", '{"step": 1, "loss": [2.0]}\n')
    raises_log_error(path, "line 1", "not a number")


def test_a_jsonl_without_a_loss_key_lists_the_keys(tmp_path):
    path = write(tmp_path, "run.jsonl", '{"step": 1, "acc": 0.5}\n')
    raises_log_error(path, "no loss (looked for loss", "keys: acc, step")


def test_torchvitals_own_event_log(tmp_path):
    """The lines as ``EventLog`` writes them from ``Report.to_dict``: the total grad norm from
    ``grad_norm_total`` (``grad_norm`` is per block), the first group's learning rate, NaN kept
    where the report says it was non-finite and None where nobody measured it, the validation
    lines skipped."""
    path = tmp_path / "run" / "events.jsonl"
    blocks = {"embed": 0.5, "head": 2.0}
    with EventLog(path) as log:
        for step in (1, 2, 3, 4):
            report = Report.from_flat(
                step=step,
                loss=1.0 / step,
                grad_norm=blocks,
                grad_norm_total=2.5,
                lr=[1e-3, 1e-4],
            )
            if step == 2:
                report.loss, report.nonfinite, report.nonfinite_loss = math.nan, True, True
            if step == 3:
                report.loss, report.grad_norm_total, report.lr = math.nan, math.nan, []
            log.write(report)
        log.write_event({"event": "validation", "step": 4, "loss": 9.0})
    line = json.loads(path.read_text().splitlines()[1])
    assert line["loss"] == "nan" and line["grad_norm"] == blocks  # what the reader has to read
    series = read_logs([str(path)])
    assert series.points[0] == LogPoint(1, 1.0, 2.5, 1e-3)
    assert math.isnan(series.points[1].loss)
    assert series.points[2] == LogPoint(3, None, None, None)
    assert series.points[3] == LogPoint(4, 0.25, 2.5, 1e-3)  # not the validation loss
    assert series.notes == [
        f"{path}: skipped the events that are no step (1 validation)",
        f"{path}: 1 line without a loss (3)",
    ]


def test_read_records_takes_dicts_like_jsonl_lines():
    series = read_records(
        [{"step": 2, "loss": 1.0, "lr": 0.1}, {"step": 1, "loss": "nan"}, {"step": 2, "loss": 0.5}]
    )
    assert [p.step for p in series.points] == [1, 2] and math.isnan(series.points[0].loss)
    assert series.points[1] == LogPoint(2, 0.5, None, None)  # the later record wins
    assert series.files == ["<records>"] and series.columns == {"loss"}
    assert series.notes == [
        "<records>: steps 2 logged again later in the file (a restart?): the later records "
        "replace them"
    ]
    with pytest.raises(LogError, match=r"^mine: record 2: not an object"):
        read_records([{"step": 1, "loss": 1.0}, 3], name="mine")
    with pytest.raises(LogError, match=r"^<records>: no step"):
        read_records([])


# ---------------------------------------------------------------- Megatron


def test_megatron_lines_among_others(tmp_path):
    path = write(
        tmp_path,
        "train.log",
        "\n".join(
            [
                "using world size: 8",
                megatron_line(100, 6.25, 1.5, prefix="[default0]: "),
                " validation loss at iteration 100 | lm loss value: 6.0 | lm loss PPL: 400 |",
                megatron_line(200, 5.5, 1.25, prefix="2024-01-01 10:00:00 [Rank 7] "),
                "",
            ]
        ),
    )
    series = read_logs([path])
    assert series.points == [LogPoint(100, 6.25, 1.5, 1e-4), LogPoint(200, 5.5, 1.25, 1e-4)]
    assert series.notes == []


def test_a_megatron_iteration_without_a_loss_is_kept_and_noted(tmp_path):
    """An fp16 overflow skips the iteration: Megatron prints neither its loss nor its norm."""
    lines = [megatron_line(s) for s in (1, 2, 5)]
    lines[1:1] = [megatron_line(s, loss=None, grad=None) for s in (3, 4)]
    path = write(tmp_path, "run.out", "\n".join(lines))
    series = read_logs([path])
    assert [p.step for p in series.points] == [1, 2, 3, 4, 5]
    assert series.points[2] == LogPoint(3, None, None, 1e-4)
    assert series.notes == [f"{path}: 2 iterations without a loss (3, 4)"]


def test_a_megatron_restart_inside_the_log_keeps_the_later_lines(tmp_path):
    first = [megatron_line(s, loss=9.0) for s in range(10, 60, 10)]
    again = [megatron_line(s, loss=1.0) for s in range(30, 80, 10)]
    path = write(tmp_path, "run.log", "\n".join([*first, "restarting from step 20", *again]))
    series = read_logs([path])
    assert [(p.step, p.loss) for p in series.points] == [
        (10, 9.0),
        (20, 9.0),
        (30, 1.0),
        (40, 1.0),
        (50, 1.0),
        (60, 1.0),
        (70, 1.0),
    ]
    assert series.notes == [
        f"{path}: steps 30-50 logged again later in the file (a restart?): the later "
        "iterations replace them"
    ]


def test_a_log_without_an_iteration_line_is_an_error(tmp_path):
    path = write(tmp_path, "run.log", "hello\nworld\n")
    raises_log_error(path, "no Megatron iteration line")
    path = write(tmp_path, "bad.log", megatron_line(1).replace("1.25", "x.5"))
    raises_log_error(path, "line 1", "'x.5' is not a number")


# ---------------------------------------------------------------- pieces, gzip, formats


def test_a_later_piece_replaces_the_steps_it_shares(tmp_path):
    a = write(tmp_path, "a.csv", "step,loss\n" + "".join(f"{s},9\n" for s in range(800, 1001, 50)))
    b = write(
        tmp_path,
        "b.jsonl",
        "".join(f'{{"step": {s}, "loss": 1}}\n' for s in (900, 950, 1000, 1050)),
    )
    series = read_logs([a, b])
    assert [(p.step, p.loss) for p in series.points] == [
        (800, 9.0),
        (850, 9.0),
        (900, 1.0),
        (950, 1.0),
        (1000, 1.0),
        (1050, 1.0),
    ]
    assert series.files == [a, b]
    assert series.notes == [f"{b} replaced steps 900-1000 of {a}"]


def test_a_resumed_piece_replaces_every_earlier_step_in_its_range(tmp_path):
    """The first attempt logged every step to 30 and died; the second resumed from step 15's
    checkpoint and logs every fifth: steps 16-30 of the first never reached the weights."""
    a = write(tmp_path, "a.csv", "step,loss\n" + "".join(f"{s},9\n" for s in range(1, 31)))
    b = write(tmp_path, "b.csv", "step,loss\n" + "".join(f"{s},1\n" for s in range(15, 41, 5)))
    series = read_logs([a, b])
    assert [p.step for p in series.points] == [*range(1, 15), 15, 20, 25, 30, 35, 40]
    assert {p.loss for p in series.points if p.step >= 15} == {1.0}
    assert series.notes == [f"{b} replaced steps 15-30 of {a}"]


def test_gzip_is_read_by_its_magic_bytes_whatever_the_name(tmp_path):
    csv_text = "step,loss\n1,2.0\n2,1.0\n"
    for name in ("run.csv.gz", "run.csv", "run.gz"):
        path = write(tmp_path, name, gzip.compress(csv_text.encode()))
        assert [p.loss for p in read_logs([path]).points] == [2.0, 1.0], name
    path = write(tmp_path, "train.log.gz", gzip.compress(megatron_line(7).encode()))
    assert read_logs([path]).points == [LogPoint(7, 2.5, 1.25, 1e-4)]


def test_a_truncated_gzip_is_an_error(tmp_path):
    data = gzip.compress(("step,loss\n" + "1,2.0\n" * 1000).encode())
    path = write(tmp_path, "run.csv.gz", data[: len(data) // 2])
    raises_log_error(path, "a truncated or corrupt gzip file")


def test_binary_junk_is_an_error(tmp_path):
    junk = bytes(range(256)) * 8
    raises_log_error(write(tmp_path, "run.csv", junk), "not UTF-8 text")
    raises_log_error(write(tmp_path, "run.jsonl", junk), "not UTF-8 text")
    raises_log_error(write(tmp_path, "run.log", junk), "no Megatron iteration line")
    raises_log_error(write(tmp_path, "run.bin", junk), "cannot tell its format", "--format")


@pytest.mark.parametrize(
    ("text", "loss"),
    [
        ('{"step": 1, "loss": 3.0}\n', 3.0),
        (megatron_line(1, loss=3.0) + "\n", 3.0),
        ("step\tloss\n1\t3.0\n", 3.0),
        ("step,loss\n1,3.0\n", 3.0),
    ],
)
def test_auto_sniffs_a_file_whose_name_says_nothing(tmp_path, text, loss):
    path = write(tmp_path, "metrics", text)
    assert read_logs([path]).points[0].loss == loss


def test_an_explicit_format_overrides_the_name(tmp_path):
    path = write(tmp_path, "run.txt", "step;loss\n1;2.0\n".replace(";", "\t"))
    assert read_logs([path], format="tsv").points == [LogPoint(1, 2.0)]
    assert "auto" in FORMATS and "megatron" in FORMATS


def test_missing_empty_and_lossless_files_are_errors(tmp_path):
    raises_log_error(str(tmp_path / "nope.csv"), "no such file")
    raises_log_error(write(tmp_path, "empty.csv", ""), "empty file")
    raises_log_error(write(tmp_path, "blank.jsonl", "\n  \n"), "empty file")
    raises_log_error(write(tmp_path, "header.csv", "step,loss\n"), "no loss in any of its 0 rows")
    raises_log_error(write(tmp_path, "none.csv", "step,loss\n1,\n2,\n"), "no loss in any of its 2")
    (tmp_path / "folder").mkdir()
    raises_log_error(str(tmp_path / "folder"), "a folder without TensorBoard event files")
    raises_log_error(str(tmp_path / "folder"), "a folder", format="csv")


def test_bad_arguments_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="format"):
        read_logs([write(tmp_path, "run.csv", "step,loss\n1,2\n")], format="xlsx")
    with pytest.raises(ConfigError, match="paths"):
        read_logs([])


def test_a_single_path_is_a_list_of_one(tmp_path):
    path = write(tmp_path, "run.csv", "step,loss\n1,2\n")
    assert read_logs(path).files == [path]


def test_tensorboard_missing_says_how_to_install_it(tmp_path, monkeypatch):
    # What an environment without it does (its submodules too: another test may have loaded them).
    for name in [n for n in sys.modules if n.split(".")[0] == "tensorboard"] + ["tensorboard"]:
        monkeypatch.setitem(sys.modules, name, None)
    path = write(tmp_path, "events.out.tfevents.1.host", b"\0" * 32)
    raises_log_error(path, "needs the tensorboard package: pip install tensorboard")
