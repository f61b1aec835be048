"""A long run's in-memory histories stay bounded, and their readers get what they got from the
whole history: the structures are driven directly over thousands of steps, and what they hold
is counted after N and after 2N steps (any per-step growth shows as a difference)."""

from __future__ import annotations

import io
import math
import random
from collections import deque

from torchvitals.agent import step as step_module
from torchvitals.agent.detect import Detector
from torchvitals.agent.detect.history import VerdictHistory, identity
from torchvitals.agent.detect.verdict import CRITICAL, HOT_LR, LOSS_SPIKE, WARNING, Verdict
from torchvitals.agent.outputs.live import LiveView
from torchvitals.agent.recover.rollback_policy import RollbackPolicy
from torchvitals.agent.report import Action, Report, Rollback
from torchvitals.agent.tools.diagnose import diagnose

NAMES = ["emb", "layers.0", "layers.1", "head", "other"]
KINDS = ["embedding", "layer", "layer", "head", "other"]


def held(obj, seen=None) -> int:
    """Items in every container reachable from ``obj`` through torchvitals' own objects."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, (list, tuple, deque, set, frozenset)):
        return len(obj) + sum(held(x, seen) for x in obj)
    if isinstance(obj, dict):
        return len(obj) + sum(held(k, seen) + held(v, seen) for k, v in obj.items())
    if type(obj).__module__.startswith("torchvitals") and hasattr(obj, "__dict__"):
        return held(vars(obj), seen)
    return 0


def report(step: int, loss: float, norms: dict[str, float], **kw) -> Report:
    total = math.sqrt(sum(v * v for v in norms.values()))
    return Report(
        step=step,
        loss=loss,
        grad_norm=norms,
        grad_norm_total=total,
        nonfinite_loss=not math.isfinite(loss),
        nonfinite_grad=not math.isfinite(total),
        nonfinite=not (math.isfinite(loss) and math.isfinite(total)),
        **kw,
    )


# ---------------------------------------------------------------- the detector


def test_a_run_dead_and_non_finite_for_thousands_of_steps_holds_no_more_at_2n_than_at_n():
    # Every growth path at once: a critical verdict every step (the history), a pipeline dead
    # from step 1 (its rule's series), a validation loss every step (the gap rule's points).
    detector = Detector(NAMES, KINDS)
    zero = dict.fromkeys(NAMES, 0.0)
    counts = []
    for step in range(1, 2401):
        detector.observe_validation(step, 1.0 + step * 1e-3)
        emitted = detector.observe(report(step, math.nan, zero, nonfinite_ranks=[1]))
        assert [v.pattern for v in emitted if v.severity == CRITICAL] == ["nonfinite_loss"]
        if step in (1200, 2400):
            counts.append(held(detector))
    assert counts[0] == counts[1], counts
    assert detector.is_active("dead_pipeline"), "the rule still judges the dead run"


def test_the_bounded_history_diagnoses_a_long_run_as_the_whole_history_does():
    rng = random.Random(0)
    detector = Detector(NAMES, KINDS)
    everything, losses = [], []
    for step in range(1, 1501):
        loss = 3.0 * 0.99 ** min(step, 100) * (1 + 0.03 * rng.gauss(0, 1))
        if step in (60, 61):
            loss *= 4  # a loss spike (two steps: one alone is an outlier the next step heals)
        if step >= 100:
            loss = math.nan  # non-finite from here on, first seen on rank 1
        norms = {b: (0.5 + 0.1 * i) * (1 + 0.1 * rng.gauss(0, 1)) for i, b in enumerate(NAMES)}
        everything += detector.observe(report(step, loss, norms, nonfinite_ranks=[1]))
        losses.append((step, loss))
    history = list(detector.history)
    assert len(everything) > 1200 and len(history) <= 1000 + 5, (len(everything), len(history))
    firsts = {}
    for v in everything:
        firsts.setdefault(identity(v), v)
    assert all(v in history for v in firsts.values()), "each finding's first verdict stays"
    assert detector.history[-100:] == everything[-100:], "what a checkpoint keeps"
    bounded, whole = diagnose(detector.history, losses), diagnose(everything, losses)
    assert bounded == whole
    # The page is the spike's second step; its first, an outlier alone, is "also seen".
    assert whole.first_step == 61 and whole.culprit and "rank 1" in whole.culprit, whole.render()


def test_the_history_keeps_the_newest_and_each_keys_first_in_emission_order():
    history = VerdictHistory(recent=10)
    rng = random.Random(1)
    emitted = [
        Verdict(rng.choice([LOSS_SPIKE, HOT_LR]), CRITICAL, step, rng.choice(["a", "b", "c"]))
        for step in range(200)
    ]
    emitted.append(Verdict(HOT_LR, WARNING, 200, "d"))  # a new key among the newest
    history.extend(emitted)
    first_index = {}
    for i, v in enumerate(emitted):
        first_index.setdefault(identity(v), i)
    kept = [
        v for i, v in enumerate(emitted) if i >= len(emitted) - 10 or first_index[identity(v)] == i
    ]
    assert list(history) == kept and len(history) == len(kept)
    assert history[-1] == emitted[-1] and list(reversed(history)) == kept[::-1]


# ---------------------------------------------------------------- the loop guard's ticks


def test_the_loop_guard_counts_as_with_every_rollback_remembered():
    def policy() -> RollbackPolicy:
        return RollbackPolicy(max_rollbacks=3, rollback_window=50, lr_backoff=0.9, skip_margin=0)

    guard, empty = policy(), held(policy())
    rng = random.Random(2)
    taken: list[int] = []  # the reference: every rollback ever taken
    tick, most = 0, 0
    for _ in range(2000):
        tick += rng.randint(1, 30)
        assert guard.recent(tick) == sum(tick - t < 50 for t in taken)
        assert guard.history(tick) == [tick - t for t in taken if tick - t < 50]
        if guard.refusal(tick, "loss_spike") is None:  # as the watchdog: abort, never loop
            guard.take(tick, to_step=0, from_position=0, position=0, replayable=False)
            taken.append(tick)
            most = max(most, held(guard) - empty)  # the most it holds: right after a take
    # The window's ticks only: at most max_rollbacks, and the one just taken.
    assert len(taken) > 500 and most <= 3 + 1, (len(taken), most)


# ---------------------------------------------------------------- outputs and benchmarks


def test_the_live_view_keeps_the_three_rollbacks_it_shows():
    view = LiveView(NAMES, stream=io.StringIO(), terminal=False, every=1000)
    counts = []
    for step in range(1, 4001):
        rolled = Rollback(to_step=step - 1, lr_scale=0.5, skipped=None)
        view.update(
            report(step, 1.0, dict.fromkeys(NAMES, 1.0), action=Action.ROLLBACK, rollback=rolled)
        )
        if step in (2000, 4000):
            counts.append(held(view))
    view.close()
    assert counts[0] == counts[1], counts
    assert [line.split(":")[0] for line in view._rollbacks] == [
        f"ROLLBACK at step {s}" for s in (3998, 3999, 4000)
    ]


def test_stage_times_keep_the_newest_steps_of_each_kind(monkeypatch):
    monkeypatch.setattr(step_module, "CURVE_KEPT", 100)  # 10^5 steps by default
    times = step_module.StageTimes()
    for n in range(110):
        times.record("unsampled", {"measure": n, "detect": 2 * n})
    stages = times.samples["unsampled"]
    assert [len(v) for v in stages.values()] == [100, 0, 100, 0, 0]
    assert list(stages["measure"]) == list(range(10, 110))
