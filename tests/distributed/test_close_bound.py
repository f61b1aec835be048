"""``agent.close()`` with a background checkpoint write in flight and a peer lost inside it, real
gloo ranks: a peer killed (SIGKILL: its sockets close) and a peer stopped (SIGSTOP: a hung host,
its sockets stay open and silent).

Either way rank 0's ``close()`` returns within ``checkpoint_close_timeout_s``, logs the step
left uncommitted, its folder and the rollback target; the ledger's last checkpoint stays the
previous one; and rank 0's process exits through the interpreter's own teardown (thread joins,
atexit handlers) with its write thread still blocked in a collective of the stopped peer.
"""

from __future__ import annotations

import pytest
from close_ranks import EVERY, STEPS, peer_lost_mid_save
from support.world import spawn_job

BOUND = 5.0
"""``checkpoint_close_timeout_s`` in these tests (the default is 60 s)."""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_close_returns_within_its_bound_when_a_peer_is_lost_mid_save(how, tmp_path):
    root = tmp_path / "ckpt"
    outcome = spawn_job(
        peer_lost_mid_save, str(root), how, BOUND, timeout=240, wait_for=[0], teardown=True
    )
    rank0, rank1 = outcome
    assert rank0["status"] == "ok", rank0.get("traceback")
    assert rank0["exitcode"] == 0 and not rank0["hung"] and not rank0["killed_by_parent"], rank0
    if how == "kill":  # it killed itself; the parent killed nothing
        assert rank1["exitcode"] == -9 and not rank1["killed_by_parent"], rank1
    else:  # stopped until the parent, done with rank 0, killed it
        assert rank1["killed_by_parent"] and rank1["status"] is None, rank1
    r = rank0["value"]

    saved = [x["step"] for x in r["reports"] if x["checkpointed"]]
    assert saved == [EVERY, STEPS] and r["in_flight"] == STEPS, (saved, r["in_flight"])

    # Bounded by the setting, not by the write (which never ends: its peer is gone or silent).
    assert r["close_seconds"] < 6 * BOUND, r["close_seconds"]
    if how == "stop":  # nothing ends that write: close() waited the whole bound
        assert r["close_seconds"] >= BOUND, r["close_seconds"]

    left = [line for line in r["errors"] if "left uncommitted at close()" in line]
    assert len(left) == 1, r["errors"]
    line = left[0]
    tmp, previous = f"{r['root']}/.tmp-step-{STEPS:08d}", f"{r['root']}/step-{EVERY:08d}"
    assert f"the checkpoint of step {STEPS} was left uncommitted" in line, line
    assert f"its folder {tmp} is never loaded" in line, line
    assert f"the last committed checkpoint, step {EVERY} ({previous}), stays the rollback " in line
    if how == "stop":
        assert f"still in flight after checkpoint_close_timeout_s={BOUND:g} s" in line, line
    assert not any("written at exit, failed" in e for e in r["errors"]), r["errors"]

    # The rollback target, for this process and for a restart, is the previous checkpoint.
    assert r["last_healthy"] == EVERY
    assert r["ledger_checkpoints"] == [EVERY], r["ledger_checkpoints"]
    assert f"step-{EVERY:08d}" in r["folders"] and f"step-{STEPS:08d}" not in r["folders"]
    assert r["held_threads"] == [], r["held_threads"]
