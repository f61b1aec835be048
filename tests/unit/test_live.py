"""The live view: plain lines off a terminal (no escape codes), a rich panel on one, from the
agent's own reports; nothing but host values from the Report."""

import io
import re

import torch
from support.models import TinyGPT, random_batches

import torchvitals
from torchvitals.agent.detect import Verdict
from torchvitals.agent.outputs.live import LiveView, ratio_bar, ratio_state, sparkline
from torchvitals.agent.report import Action, Report, Rollback

ANSI = re.compile(r"\x1b\[")


def _report(step, **kw):
    base = dict(step=step, loss=2.0, grad_norm={"a": 0.5, "b": 0.25}, grad_norm_total=0.56)
    return Report(**{**base, **kw})


def test_plain_lines_carry_status_verdicts_and_the_rollback_without_escape_codes():
    stream = io.StringIO()
    view = LiveView(["a", "b"], stream=stream, every=10)
    assert not view.terminal  # StringIO is not a terminal
    for step in range(1, 10):
        view.update(_report(step))
    warn = Verdict("hot_lr", "warning", 10, "a", {"update_ratio": 0.03})
    view.update(_report(10, update_ratio={"a": 0.03, "b": 1e-3}, verdicts=[warn]))
    crit = Verdict("loss_spike", "critical", 12, None, {"loss": 9.0})
    view.update(
        _report(
            12,
            loss=9.0,
            verdicts=[crit],
            action=Action.ROLLBACK,
            rollback=Rollback(to_step=10, lr_scale=0.5, skipped=(10, 14)),
        ),
        recovery={"lr_scale": 0.5, "rollbacks": 1},
    )
    view.close()
    lines = stream.getvalue().splitlines()
    assert not ANSI.search(stream.getvalue())
    assert lines[0].startswith("step     1  loss")
    assert not any(line.startswith("step     5") for line in lines)  # only every 10 steps
    assert any(line.startswith("step    10") for line in lines)
    assert "  update_ratio a 3.0e-02  b 1.0e-03" in lines
    assert "  WARNING step 10: hot_lr in a (update_ratio=0.03)" in lines
    assert "  CRITICAL step 12: loss_spike (loss=9)" in lines
    assert (
        "  ROLLBACK at step 12: back to the healthy checkpoint of step 10, learning rate x0.5, "
        "batches 10..13 skipped (4)"
    ) in lines
    assert any("lr_scale 0.5  action rollback" in line for line in lines)


def test_a_rollback_that_reseeded_the_loops_rngs_is_shown_too():
    """A loop that draws its own batches skips none: the rollback line says the RNGs were
    re-seeded instead (``skipped`` is None)."""
    stream = io.StringIO()
    view = LiveView(["a", "b"], stream=stream, every=10)
    rolled = Rollback(to_step=10, lr_scale=0.25, skipped=None)
    view.update(_report(13, action=Action.ROLLBACK, rollback=rolled))
    view.close()
    assert (
        "  ROLLBACK at step 13: back to the healthy checkpoint of step 10, learning rate x0.25, "
        "the loop's RNGs re-seeded"
    ) in stream.getvalue().splitlines()


def test_terminal_panel_shows_blocks_bars_and_active_verdicts():
    stream = io.StringIO()
    view = LiveView(
        ["tok_emb", "blocks.0"], stream=stream, terminal=True, clock=iter(range(100)).__next__
    )
    warn = Verdict("dead_layer", "warning", 3, "blocks.0", {})
    for step in range(1, 4):
        view.update(
            _report(
                step,
                grad_norm={"tok_emb": 0.1 * step, "blocks.0": 0.2},
                update_ratio={"tok_emb": 1e-3, "blocks.0": 0.0},
                activations={"tok_emb": {"abs_max": 3.5}},
            ),
            active=[warn] if step == 3 else [],
        )
    view.close()
    text = stream.getvalue()
    assert "tok_emb" in text and "blocks.0" in text and "dead_layer@blocks.0" in text
    assert "3.5" in text and "1.0e-03" in text


def test_bars_and_sparklines():
    assert sparkline([1, 2, 3, float("nan")]) == "▁▅█ "
    assert sparkline([]) == ""
    # 1e-3 sits at 3/5 of the 1e-6..1e-1 scale: 7 of 12 cells, reaching the mark exactly.
    assert ratio_bar(1e-3) == "███████     "
    assert ratio_bar(0.0) == "      |     "  # nothing moved: only the 1e-3 mark
    assert ratio_bar(0.5) == "█" * 12
    assert [ratio_state(x) for x in (0.05, 1e-3, 0.0)] == ["hot", "ok", "dead"]


def test_agent_with_live_on_writes_its_reports_as_lines(capsys):
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=32, n_layers=2, n_heads=4, seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torchvitals.watch(model, opt, live=True, sample_every=5) as agent:
        for x, y in random_batches(10, batch=4, seq_len=16, vocab=32):
            loss = model.loss(x, y)
            loss.backward()
            report = agent.step(loss)
            opt.zero_grad(set_to_none=True)
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("step     1  loss")
    assert f"step    10  loss {report.loss:8.4f}" in out  # the agent's own report
    assert not ANSI.search(out)


def test_an_abort_line_names_the_pattern_that_ended_the_run():
    """The loop guard's abort and a collector's abort order both end the run: the line says
    which (the critical verdict the abort step carries)."""
    stream = io.StringIO()
    view = LiveView(["a", "b"], stream=stream, every=10)
    ordered = Verdict("collector_directive", "critical", 30, None, {"action": "abort"})
    view.update(_report(30, action=Action.ABORT, verdicts=[ordered]))
    view.close()
    assert "  ABORT at step 30: collector_directive" in stream.getvalue().splitlines()
