"""Which checkpoints a rollback may go back to: trusted after clean steps, distrusted when
trouble follows them or a rollback to them does not cure, and the ledger that keeps it across a
restart."""

from __future__ import annotations

import json

import pytest

from torchvitals.agent.recover.targets import Repeat, Targets
from torchvitals.records.ledger import Ledger, LedgerError


def _targets(**kw) -> Targets:
    return Targets(**{"trust_steps": 2, "verify_steps": 20, **kw})


def _saved(t: Targets, *steps: int) -> None:
    for s in steps:
        t.saved(s)
        assert t.committed(s) == {}


def test_a_checkpoint_is_a_target_only_after_clean_steps():
    t = _targets()
    _saved(t, 10)
    assert t.target() is None
    assert t.note(11, None) == {} and t.target() is None, "one clean step of two"
    assert t.note(12, None) == {} and t.target() == 10


def test_trouble_right_after_a_checkpoint_distrusts_it_and_the_older_one_stays_the_target():
    """The hot update of step 60 is in the checkpoint of 60; the loss shows it at 61."""
    t = _targets()
    _saved(t, 50)
    t.note(51, None)
    t.note(52, None)
    _saved(t, 60)
    distrusted = t.note(61, "loss_outlier")
    assert (
        list(distrusted) == [60]
        and "loss_outlier at step 61, 1 step(s) after it" in (distrusted[60])
    )
    assert t.target() == 50 and t.last_resort() == 60
    assert t.note(62, "loss_spike") == {}, "judged once"
    assert list(t.rolled_back(62, 50)) == [60], "abandoned: no last resort now"
    assert t.last_resort() is None and "newer than step 50" in t.distrusted[60]


def test_a_checkpoint_distrusted_before_its_commit_is_reported_at_the_commit():
    """A background write commits steps later: the ledger records the checkpoint, then why it
    is distrusted, in that order."""
    t = _targets()
    t.saved(60)
    assert t.note(61, "grad_spike") == {}, "not committed yet: nothing for the ledger"
    assert list(t.committed(60)) == [60] and t.target() == t.last_resort() == 60, (
        "distrusted, but the only one: a last resort"
    )


def test_a_rollback_abandons_newer_checkpoints_and_a_repeat_distrusts_its_target():
    t = _targets()
    for s in (10, 20, 30):
        _saved(t, s)
        t.note(s + 1, None)
        t.note(s + 2, None)
    assert t.target() == 30
    assert t.repeat(35) is None, "a first rollback"
    assert list(t.rolled_back(35, 20)) == [30]
    assert "newer than step 20" in t.distrusted[30] and t.target() == 20
    repeat = t.repeat(35)  # the replay met it again, before 35 + verify_steps
    assert repeat == Repeat(of=35, to_step=20, escalation=1)
    assert list(t.fail_verification(repeat, 35, "loss_spike")) == [20]
    assert t.target() == 10 and t.escalation == 1
    t.rolled_back(35, 10)
    for s in range(11, 56):
        t.note(s, None)
    assert t.repeat(56) is None and t.escalation == 0, "55 = 35 + 20: cured"


def test_a_step_saved_again_after_a_rollback_is_trusted_afresh():
    t = _targets()
    _saved(t, 10, 20)
    for s in (11, 12, 21, 22):
        t.note(s, None)
    t.rolled_back(25, 10)
    assert 20 in t.distrusted
    _saved(t, 20)  # the replay reaches 20 again
    assert 20 not in t.distrusted and t.target() == 10
    t.note(21, None)
    t.note(22, None)
    assert t.target() == 20


def test_a_resumed_run_trusts_what_the_ledger_committed_and_not_what_it_distrusted():
    t = _targets(committed=[10, 20, 30], distrusted={30: "loss_outlier at step 31"})
    assert t.target() == 20
    t.forget(20)  # pruned
    assert t.target() == 10 and t.candidates() == {10}
    with pytest.raises(ValueError, match="trust_steps"):
        Targets(trust_steps=0, verify_steps=1)


def test_the_ledger_keeps_what_was_distrusted_until_the_step_is_saved_again(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.record_checkpoint(10, tmp_path / "step-00000010")
    ledger.record_checkpoint(20, tmp_path / "step-00000020")
    ledger.record_distrust(20, tmp_path / "step-00000020", "loss_outlier at step 21")
    read = Ledger(tmp_path / "ledger.json").load()
    assert read.distrusted() == {"step-00000020": "loss_outlier at step 21"}
    read.record_checkpoint(20, tmp_path / "step-00000020")  # saved again after a rollback
    assert Ledger(tmp_path / "ledger.json").load().distrusted() == {}


def test_a_ledger_that_distrusts_a_checkpoint_it_never_recorded_is_refused(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = Ledger(path)
    ledger.record_checkpoint(10, tmp_path / "step-00000010")
    ledger.record_distrust(10, tmp_path / "step-00000010", "why")
    document = json.loads(path.read_text())
    document["entries"][1]["step"] = 20
    document["entries"][1]["path"] = str(tmp_path / "step-00000020")
    path.write_text(json.dumps(document))
    with pytest.raises(LedgerError, match="not a checkpoint of step 20 recorded before it"):
        Ledger(path).load()


def test_what_the_store_prunes_is_forgotten_so_nothing_grows_with_the_run():
    """The store keeps the newest ``checkpoint_keep`` not distrusted; so do the targets (and
    with them the detector snapshots the step keeps per candidate)."""
    t = _targets(keep=2)
    for s in (10, 20, 30, 40):
        _saved(t, s)
        t.note(s + 1, None)
        t.note(s + 2, None)
    assert t.candidates() == {30, 40} and t.target() == 40
    resumed = _targets(keep=2, committed=[10, 20, 30], distrusted={30: "why"})
    assert resumed.candidates() == {10, 20}


def test_the_ledger_records_why_each_checkpoint_is_trusted_and_a_restart_reads_it(tmp_path):
    """Trust earned is recorded (the clean steps, the state's fingerprint); a restart trusts
    what was recorded so and watches again the checkpoint that had not earned it yet (saved at
    20, the job crashed at 21): it is the restart's resume point, but not a rollback target
    until clean steps follow it again."""
    from torchvitals.agent.recover.watchdog import _targets as from_ledger

    live = Targets(trust_steps=2, verify_steps=20)
    ledger = Ledger(tmp_path / "ledger.json")
    for step in (10, 20):
        live.saved(step)
        live.committed(step)
        ledger.record_checkpoint(step, tmp_path / f"step-{step:08d}")
        if step == 10:
            live.note(11, None)
            live.note(12, None)
    assert live.take_trusted() == [(10, 12)] and live.take_trusted() == []
    ledger.record_trust(10, tmp_path / "step-00000010", clean_through=12, fingerprint="00ab")
    read = Ledger(tmp_path / "ledger.json").load()
    assert read.trusted() == {"step-00000010": read.entries[-1]}
    assert read.entries[-1]["clean_through"] == 12 and read.entries[-1]["fingerprint"] == "00ab"
    restarted = from_ledger(read, trust_steps=2, verify_steps=20, keep=5)
    assert restarted.target() == 10, "20 has not earned trust"
    restarted.note(21, None)
    restarted.note(22, None)
    assert restarted.target() == 20 and restarted.take_trusted() == [(20, 22)]
    # A distrust after the trust takes it back; a later save of the step starts over.
    read.record_distrust(10, tmp_path / "step-00000010", "the rollback to it did not cure")
    assert Ledger(tmp_path / "ledger.json").load().trusted() == {}


def test_a_ledger_from_before_trust_records_trusts_its_checkpoints_as_it_did(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = Ledger(path)
    ledger.record_checkpoint(10, tmp_path / "step-00000010")
    document = json.loads(path.read_text())
    del document["trust_from"]  # as a ledger written before trust records
    path.write_text(json.dumps(document))
    old = Ledger(path).load()
    assert old.trust_from == 1 and set(old.trusted()) == {"step-00000010"}
    old.record_checkpoint(20, tmp_path / "step-00000020")  # saved by the new version
    again = Ledger(path).load()
    assert again.trust_from == 1 and set(again.trusted()) == {"step-00000010"}


def test_a_trust_record_not_earned_by_later_steps_is_refused(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = Ledger(path)
    ledger.record_checkpoint(10, tmp_path / "step-00000010")
    ledger.record_trust(10, tmp_path / "step-00000010", clean_through=10)
    with pytest.raises(LedgerError, match="clean_through 10 is not after step 10"):
        Ledger(path).load()
