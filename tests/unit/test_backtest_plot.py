"""``torchvitals backtest --plot``: the picture is written, and a path it cannot write is one line.

Not in the torch-free set: the torch-free venvs hold no matplotlib.
"""

from __future__ import annotations

from torchvitals.__main__ import main


def write_log(path, steps=400, spike_at=250):
    rows = [
        f"{s},{3.0 - s * 1e-3 + (2.0 if s == spike_at else 0.0)},{0.5}\n" for s in range(1, steps)
    ]
    path.write_text("step,loss,grad_norm\n" + "".join(rows))
    return path


def test_the_plot_is_a_png_beside_the_summary(tmp_path, capsys):
    log, png = write_log(tmp_path / "run.csv"), tmp_path / "run.png"
    assert main(["backtest", str(log), "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert "loss_outlier x1: steps 250" in captured.out and f"plot: {png}" in captured.err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_plot_path_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capsys):
    log = write_log(tmp_path / "run.csv")
    target = tmp_path / "missing-folder" / "run.png"
    assert main(["backtest", str(log), "--plot", str(target)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("torchvitals backtest: --plot ") and str(target) in line
