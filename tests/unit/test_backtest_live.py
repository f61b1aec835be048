"""The live agent and the backtest of its own event log name the same findings at the same steps.

One recorded run drives both: a small GPT trains under ``watch(log_dir=...)`` with a bad batch
(one step), a gradient-norm spike the loss does not show, and a spike that persists; the
replay of the ``events.jsonl`` it wrote must find what the agent found, from the loss and the
total gradient norm alone.
"""

from __future__ import annotations

import torch
from support.models import TINY, TinyGPT, random_batches

import torchvitals
from torchvitals.agent.detect.verdict import CRITICAL

BATCHES = list(random_batches(80, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))
JUDGED = {
    "loss_spike",
    "loss_outlier",
    "loss_divergence",
    "grad_spike",
    "grad_explosion",
    "nonfinite_loss",
    "nonfinite_grad",
}
"""The patterns a log of losses and total gradient norms can show (the others need per-block
norms, update ratios or activations)."""


def record_run(folder) -> list:
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    agent = torchvitals.watch(model, opt, log_dir=str(folder), run_name="run")
    reports = []
    try:
        while agent.step_count < 200:
            for x, y in agent.batches(BATCHES):
                step = agent.step_count + 1
                loss = model.loss(x, y)
                if step in (90, 140, 141):  # a bad batch at 90; a spike that stays at 140
                    loss = loss * 3
                loss.backward()
                if step == 120:  # the gradients jump, the loss does not
                    for p in model.parameters():
                        p.grad.mul_(6)
                reports.append(agent.step(loss))
                opt.zero_grad(set_to_none=True)
                if agent.step_count >= 200:
                    break
    finally:
        agent.close()
    return reports


def live_episodes(reports) -> list[tuple[str, str, int]]:
    """The live verdicts as the backtest groups them: each warning once (the detector emits it
    when it becomes active), each run of a critical one from its first step."""
    found, held = [], set()
    for report in reports:
        now = {v.pattern for v in report.verdicts if v.severity == CRITICAL}
        for v in report.verdicts:
            if v.pattern in JUDGED and (v.severity != CRITICAL or v.pattern not in held):
                found.append((v.pattern, v.severity, report.step))
        held = now
    return found


def test_the_backtest_of_a_runs_event_log_finds_what_the_agent_found(tmp_path):
    reports = record_run(tmp_path)
    live = live_episodes(reports)
    assert live == [
        ("loss_outlier", "warning", 90),
        ("grad_spike", "warning", 120),
        ("loss_outlier", "warning", 140),
        ("loss_spike", "critical", 141),
    ]
    result = torchvitals.backtest(tmp_path / "run" / "events.jsonl")
    assert (result.steps, result.first_step, result.last_step) == (200, 1, 200)
    assert [(e.pattern, e.severity, e.step) for e in result.episodes] == live
    # The same numbers behind each: the replay judged the logged values the agent reduced. (The
    # ranks a spike names come from each rank's own flag in the step's sums: a log of the mean
    # loss cannot show them.)
    by_step = {r.step: r for r in reports}
    for e in result.episodes:
        live_verdict = next(v for v in by_step[e.step].verdicts if v.pattern == e.pattern)
        live = {
            k: x
            for k, x in live_verdict.evidence.items()
            if k not in ("ranks", "rank_count", "culprit_from")
        }
        assert e.evidence == live
