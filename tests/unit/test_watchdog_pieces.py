"""The watchdog's pieces, each on its own: no Watchdog, no process group, no agent.

Save policy (healthy, due), rollback policy (back-off, skipped range, loop guard), resume policy,
the saver interface over both implementations, and the facade assembled from those pieces over
a tmp folder with a fake clock.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch

from torchvitals.agent.detect.verdict import (
    CRITICAL,
    HOT_LR,
    INFO,
    LOSS_SPIKE,
    STRAGGLER,
    WARNING,
    Verdict,
)
from torchvitals.agent.recover import checkpoint
from torchvitals.agent.recover.agreement import Ranks
from torchvitals.agent.recover.checkpoint import CheckpointError, CheckpointStore
from torchvitals.agent.recover.resume_policy import ResumePolicy, ResumeRefused, restarted
from torchvitals.agent.recover.rollback_policy import Rollback, RollbackPolicy
from torchvitals.agent.recover.save_policy import SavePolicy
from torchvitals.agent.recover.saver import Saver, SyncSaver
from torchvitals.agent.recover.staged import StagedSaves
from torchvitals.agent.recover.watchdog import TrainingAborted, Watchdog
from torchvitals.protocol import ATTEMPT_ENV
from torchvitals.records.ledger import Ledger

HOT = Verdict(HOT_LR, WARNING, 10, "a")


# ---------------------------------------------------------------- save policy


def test_a_step_is_healthy_only_past_the_window_of_the_last_bad_verdict():
    policy = SavePolicy(checkpoint_every=10, healthy_window=5)
    assert policy.healthy(1, [])
    policy.note(10, [Verdict(LOSS_SPIKE, CRITICAL, 10, None)])
    assert [policy.healthy(s, []) for s in (14, 15, 16)] == [False, False, True]
    policy.note(20, [Verdict(STRAGGLER, WARNING, 20, None), Verdict(HOT_LR, INFO, 20, "a")])
    assert policy.healthy(20, []), "process warnings and info say nothing of the weights"


def test_an_active_warning_keeps_every_step_unhealthy():
    policy = SavePolicy(checkpoint_every=10, healthy_window=5)
    assert not policy.healthy(100, [HOT]), "raised at step 10 and still holding"
    assert policy.healthy(100, [Verdict(STRAGGLER, WARNING, 99, None)])


def test_a_save_is_due_on_a_healthy_multiple_of_checkpoint_every():
    policy = SavePolicy(checkpoint_every=10, healthy_window=3)
    assert [s for s in range(1, 41) if policy.due(s, [])] == [10, 20, 30, 40]
    policy.note(28, [HOT])
    assert not policy.due(30, [])
    policy.restart_at(40)  # a rollback back to 40: the window starts there
    assert not policy.due(40, []) and policy.due(50, [])
    with pytest.raises(ValueError):
        SavePolicy(checkpoint_every=0, healthy_window=3)


# ---------------------------------------------------------------- rollback policy


def _rollbacks(**overrides):
    settings = dict(max_rollbacks=2, rollback_window=100, lr_backoff=0.5, skip_margin=3)
    settings.update(overrides)
    return RollbackPolicy(**settings)


def test_each_rollback_backs_the_learning_rate_off_and_skips_what_led_there():
    policy = _rollbacks(lr_scale=0.5)  # a resumed run: the ledger's scale
    first = policy.take(5, to_step=20, from_position=20, position=31, replayable=True)
    assert first == Rollback(to_step=20, lr_scale=0.25, skipped=(20, 34))
    assert first.to_dict() == {
        "to_step": 20,
        "lr_scale": 0.25,
        "skipped": [20, 34],
        "repeat_of": None,
        "escalation": 0,
    }
    second = policy.take(9, to_step=20, from_position=20, position=25, replayable=False)
    assert second.skipped is None and second.to_dict()["skipped"] is None
    assert (second.lr_scale, policy.recent(9), policy.rollbacks) == (0.125, 2, 2)


def test_a_repeat_cuts_the_learning_rate_again_and_widens_the_skip_per_escalation():
    policy = _rollbacks(max_rollbacks=5)
    policy.take(5, to_step=20, from_position=20, position=31, replayable=True)
    again = policy.take(
        9, to_step=10, from_position=10, position=35, replayable=True, escalation=1, repeat_of=5
    )
    assert again == Rollback(
        to_step=10, lr_scale=0.125, skipped=(10, 41), repeat_of=5, escalation=1
    )  # 0.5 x 0.5^2; margin 3 x 2
    third = policy.take(12, to_step=0, from_position=0, position=40, replayable=True, escalation=2)
    assert (third.lr_scale, third.skipped) == (0.125 * 0.5**3, (0, 52))  # margin 3 x 4
    assert Rollback.from_dict(again.to_dict()) == again


def test_the_loop_guard_refuses_one_rollback_too_many_within_the_window():
    policy = _rollbacks()
    assert policy.refusal(0, "loss_spike") is None
    policy.take(0, to_step=0, from_position=0, position=1, replayable=True)
    policy.take(50, to_step=0, from_position=0, position=1, replayable=True)
    why = policy.refusal(99, "loss_spike")
    assert why == "3 rollbacks within 100 steps (max_rollbacks=2); last: loss_spike"
    assert policy.refusal(100, "loss_spike") is None, "the first one left the window"
    assert _rollbacks(max_rollbacks=0).refusal(0, "x") is not None


@pytest.mark.parametrize(
    "bad",
    [
        dict(lr_backoff=0.0),
        dict(lr_backoff=1.5),
        dict(rollback_window=0),
        dict(max_rollbacks=-1),
        dict(skip_margin=-1),
    ],
)
def test_a_rollback_policy_out_of_range_is_refused(bad):
    with pytest.raises(ValueError):
        _rollbacks(**bad)


# ---------------------------------------------------------------- resume policy


@pytest.mark.parametrize(
    "mode, environ, continues",
    [
        ("auto", {}, True),
        ("never", {ATTEMPT_ENV: "3"}, False),
        ("restart", {}, False),
        ("restart", {"TORCHELASTIC_RESTART_COUNT": "1"}, True),
        ("restart", {"TORCHELASTIC_RESTART_COUNT": "zero"}, False),
    ],
)
def test_resume_continues_a_folder_only_as_the_mode_allows(tmp_path, mode, environ, continues):
    policy = ResumePolicy(mode, environ=environ)
    assert policy.continues() is continues
    ledger = Ledger(tmp_path / "ledger.json", writer=False)
    if continues:
        policy.check(tmp_path / "step-00000010", ledger)
    else:
        with pytest.raises(ResumeRefused, match=f'step-00000010.*resume="auto".*resume={mode!r}'):
            policy.check(tmp_path / "step-00000010", ledger)


def test_restarted_reads_the_supervisor_and_torchrun():
    assert not restarted({}) and restarted({ATTEMPT_ENV: "2"}) and not restarted({ATTEMPT_ENV: "1"})
    with pytest.raises(ValueError, match="resume must be"):
        ResumePolicy("sometimes")


# ---------------------------------------------------------------- saver, both implementations


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, steps=1):
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("staged", [False, True])
def test_either_saver_writes_a_checkpoint_the_store_loads(tmp_path, staged):
    store = CheckpointStore(tmp_path)
    saver: Saver = StagedSaves(store, 1 << 30) if staged else SyncSaver(store)
    model, opt = _model()
    _train(model, opt)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = saver.save(1, model, opt, None, {"position": 1}, None)
    assert saved.stall_seconds > 0 and saved.earlier is None
    if staged:  # in flight until it settles: every rank's flags say done
        assert saved.committed is None and saver.in_flight
        outcome = saver.wait()
        assert saver.flags() == [0.0, 0.0] and not saver.in_flight
    else:  # written within the call; nothing in flight
        outcome = saved.committed
        assert not saver.in_flight and saver.wait() is None and saver.flags() == [0.0, 0.0]
    assert outcome.ok and outcome.step == 1 and outcome.path == str(tmp_path / "step-00000001")
    _train(model, opt, 3)
    restored = saver.restore(1, model, opt, None)
    if staged:  # from RAM, the weights of step 1
        assert restored.step == 1 and restored.path is None and restored.extra == {"position": 1}
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
        assert saver.restore(2, model, opt, None) is None, "only the step it holds"
    else:
        assert restored is None, "a synchronous saver holds nothing in memory"
    assert store.load(model, opt).step == 1


def test_the_staged_saver_settles_once_the_reduced_flags_say_every_rank_is_done(tmp_path):
    saver = StagedSaves(CheckpointStore(tmp_path), 1 << 30)
    model, opt = _model()
    saver.save(1, model, opt, None, {}, None)
    assert saver.settle([0.0, 0.0], world_size=2) is None  # no rank done yet
    saver.saver._thread.join(60)
    assert saver.flags() == [1.0, 0.0]
    assert saver.settle([1.0, 0.0], world_size=2) is None  # the other rank is not done
    outcome = saver.settle([2.0, 0.0], world_size=2)
    assert outcome.ok and saver.memory.step == 1


# ---------------------------------------------------------------- the facade from pieces


def _watchdog(root, staged=False, close_timeout_s=60.0, **rollback):
    store = CheckpointStore(root)
    ledger = Ledger(root / "ledger.json", clock=lambda: 1000.0)  # fresh: nothing read
    return Watchdog(
        store=store,
        saver=StagedSaves(store, 1 << 30) if staged else SyncSaver(store),
        ledger=ledger,
        save_policy=SavePolicy(checkpoint_every=2, healthy_window=0),
        rollback_policy=_rollbacks(**rollback),
        resume_policy=ResumePolicy("auto"),
        abort_exit_code=79,
        close_timeout_s=close_timeout_s,
    )


class _Detector:
    """What the facade reads of a detector: active verdicts, pinned ones, the history."""

    def __init__(self):
        self.active, self.pinned, self.history = {}, set(), []


def test_the_watchdog_from_pieces_saves_rolls_back_and_trips_the_guard(tmp_path):
    dog = _watchdog(tmp_path, max_rollbacks=1)
    model, opt = _model()
    detector = _Detector()
    assert dog.rollback(1, 1, "loss_spike", model, opt, None) is None, "no checkpoint yet"
    assert not dog.maybe_save(1, model, opt, None, detector)
    assert dog.maybe_save(2, model, opt, None, detector)
    assert dog.last_healthy == 2 and dog.metrics()["checkpoint_seconds"] > 0
    dog.note(3, [])  # two clean steps after it: step 2 is trusted (trust_steps=2)
    dog.note(4, [])
    rolled = dog.rollback(5, 5, "loss_spike", model, opt, None)
    assert rolled == Rollback(to_step=2, lr_scale=0.5, skipped=None)
    assert dog.lr_scale == 0.5 and dog.rollbacks == 1
    with pytest.raises(TrainingAborted) as aborted:
        dog.rollback(4, 6, "loss_spike", model, opt, None)
    assert aborted.value.code == 79 and aborted.value.why.startswith("2 rollbacks within")
    events = [e["event"] for e in json.loads((tmp_path / "ledger.json").read_text())["entries"]]
    assert events == ["checkpoint", "trust", "rollback", "abort"]


# ---------------------------------------------------------------- the background-write groups


# ---------------------------------------------------------------- close() with a write in flight


def _close_with_step_4_in_flight(dog, write_step_4, monkeypatch):
    """Commit step 2's background save, start step 4's with ``write_step_4`` called as it
    writes its shards, then close."""
    model, opt = _model()
    detector = _Detector()
    assert dog.maybe_save(2, model, opt, None, detector)
    real = checkpoint.write_shards

    def write_shards(tmp, tensors, ranks):
        if tmp.name == ".tmp-step-00000004":
            write_step_4()
        real(tmp, tensors, ranks)

    monkeypatch.setattr(checkpoint, "write_shards", write_shards)
    assert dog.maybe_save(4, model, opt, None, detector)  # step 2's write ends first
    assert dog.last_healthy == 2 and dog.saver.pending_step == 4
    dog.close()


def _ledger_steps(root):
    entries = json.loads((root / "ledger.json").read_text())["entries"]
    return [e["step"] for e in entries if e["event"] == "checkpoint"]


def test_close_leaves_a_write_still_held_after_its_bound_uncommitted_and_says_so(
    tmp_path, caplog, monkeypatch
):
    dog = _watchdog(tmp_path, staged=True, close_timeout_s=0.05)
    held = threading.Event()  # the write of step 4 waits on it, as on a stopped peer
    try:
        with caplog.at_level(logging.ERROR, "torchvitals"):
            _close_with_step_4_in_flight(dog, lambda: held.wait(120), monkeypatch)
        assert [r.getMessage() for r in caplog.records] == [
            "torchvitals: the checkpoint of step 4 was left uncommitted at close(): its write "
            "was still in flight after checkpoint_close_timeout_s=0.05 s (a peer died or "
            f"stopped mid-save); its folder {tmp_path}/.tmp-step-00000004 is never loaded, and "
            f"the last committed checkpoint, step 2 ({tmp_path}/step-00000002), stays the "
            "rollback target"
        ]
        assert dog.last_healthy == 2 and _ledger_steps(tmp_path) == [2]
        assert dog.store.latest() == tmp_path / "step-00000002"
        assert (tmp_path / ".tmp-step-00000004").is_dir()
    finally:
        held.set()
        for thread in threading.enumerate():
            if thread.name == "torchvitals-checkpoint-4":
                assert thread.daemon, "a write thread must never hold the interpreter's exit"
                thread.join(60)


def test_close_returns_when_the_write_lost_a_peer_and_raises_when_every_rank_failed(
    tmp_path, caplog, monkeypatch
):
    lost = []
    real_gather = Ranks.gather

    def gather(ranks, fn):
        results = real_gather(ranks, fn)
        if lost:  # the phase's collective, as gloo fails it once a peer died
            raise RuntimeError("Connection reset by peer")
        return results

    monkeypatch.setattr(Ranks, "gather", gather)
    dog = _watchdog(tmp_path / "lost", staged=True)
    with caplog.at_level(logging.ERROR, "torchvitals"):
        _close_with_step_4_in_flight(dog, lambda: lost.append(True), monkeypatch)
    [line] = [r.getMessage() for r in caplog.records]
    assert "step 4 was left uncommitted at close(): its write lost a peer (" in line, line
    assert "Connection reset by peer" in line and "step 2 (" in line, line
    assert dog.last_healthy == 2 and _ledger_steps(tmp_path / "lost") == [2]
    assert dog.metrics()["checkpoint_failures"] == 1
    lost.clear()

    def disk_full():
        raise OSError(28, "No space left on device")

    dog = _watchdog(tmp_path / "full", staged=True)
    # Every rank's phases agree on that failure: the exit status must say it.
    with pytest.raises(CheckpointError, match=r"step 4, written at exit, failed: .*No space left"):
        _close_with_step_4_in_flight(dog, disk_full, monkeypatch)
    assert dog.last_healthy == 2 and _ledger_steps(tmp_path / "full") == [2]
    assert not (tmp_path / "full" / ".tmp-step-00000004").exists(), "a failed save cleans up"
