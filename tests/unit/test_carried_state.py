"""The watchdog's state a framework's own checkpoint carries (agent/recover/carried.py): it goes
through DCP as one tensor, comes back checked, and is adopted without loosening the back-off.
The restart through torchtitan's real CheckpointManager: tests/integration/test_torchtitan.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchvitals.agent.config import Config
from torchvitals.agent.recover.carried import (
    CAPACITY,
    CarriedState,
    CarriedStateError,
    adopt,
    carried_state,
)
from torchvitals.agent.recover.watchdog import Watchdog
from torchvitals.records.ledger import Ledger


def _watchdog(tmp_path) -> Watchdog:
    return Watchdog.open(
        Config(
            checkpoint_dir=str(tmp_path / "ckpt"),
            max_rollbacks=2,
            rollback_window=100,
            lr_backoff=0.5,
        )
    )


def test_the_state_goes_through_dcp_as_one_fixed_size_tensor_and_back(tmp_path):
    state = CarriedState(
        step=120,
        lr_scale=0.25,
        skipped=[(100, 112), (130, 134)],
        position=140,
        rollbacks_ago=[31, 4],
    )
    dcp.save({"torchvitals": {"document": state.to_tensor()}}, checkpoint_id=str(tmp_path))
    # a fresh process's load template: the same shape, whatever it holds
    template = {"torchvitals": {"document": CarriedState(step=0).to_tensor()}}
    dcp.load(template, checkpoint_id=str(tmp_path))
    assert template["torchvitals"]["document"].shape == (CAPACITY,)
    assert CarriedState.from_tensor(template["torchvitals"]["document"]) == state


def _tensor(doc: dict) -> torch.Tensor:
    raw = json.dumps(doc).encode()
    out = torch.zeros(CAPACITY, dtype=torch.uint8)
    out[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return out


GOOD = {
    "version": 1,
    "step": 12,
    "lr_scale": 0.5,
    "skipped": [[3, 5]],
    "position": 9,
    "rollbacks_ago": [2],
}


@pytest.mark.parametrize(
    "change",
    [
        {"version": 2},
        {"lr_scale": 0.0},
        {"lr_scale": 1.5},
        {"lr_scale": float("nan")},
        {"lr_scale": "0.5"},
        {"step": -1},
        {"step": 1.5},
        {"position": True},
        {"skipped": [[5, 3]]},
        {"skipped": [[1, 2, 3]]},
        {"skipped": "all"},
        {"rollbacks_ago": [-1]},
        {"rollbacks_ago": None},
    ],
)
def test_a_value_no_run_could_have_written_is_refused(change):
    assert CarriedState.from_tensor(_tensor(GOOD)).lr_scale == 0.5
    with pytest.raises(CarriedStateError):
        CarriedState.from_tensor(_tensor({**GOOD, **change}))


def test_a_tensor_that_is_not_the_state_is_refused():
    for tensor in (
        torch.zeros(4, dtype=torch.float32),
        torch.full((8,), 0xFF, dtype=torch.uint8),
        torch.zeros(2, 2, dtype=torch.uint8),
    ):
        with pytest.raises(CarriedStateError):
            CarriedState.from_tensor(tensor)
    with pytest.raises(CarriedStateError, match="over the"):
        CarriedState(step=1, rollbacks_ago=list(range(CAPACITY))).to_tensor()


def test_adopting_keeps_the_smaller_back_off_the_union_of_skips_and_the_recent_rollbacks(tmp_path):
    watchdog = _watchdog(tmp_path)
    state = CarriedState(
        step=12, lr_scale=0.5, skipped=[(10, 14)], position=14, rollbacks_ago=[50, 2]
    )
    adopt(watchdog, state, tick=0, source="torchtitan checkpoint step-12")
    assert watchdog.lr_scale == 0.5 and list(watchdog.ledger.skipped) == [(10, 14)]
    assert watchdog.data.position == 14
    assert watchdog.rollback_policy.recent(0) == 2  # both counted from the start of this process
    assert watchdog.rollback_policy.refusal(0, "nan") is not None  # max_rollbacks=2: a third aborts
    assert watchdog.rollback_policy.refusal(60, "nan") is None  # 50 + 60 past the window
    # the ledger says it, and its own check holds on the next load
    again = Ledger(watchdog.ledger.path).load()
    assert again.lr_scale == 0.5 and list(again.skipped) == [(10, 14)]
    assert [(e["event"], e["step"], e["skipped"]) for e in again.entries] == [
        ("adopt", 12, [[10, 14]])
    ]
    # an older state never loosens it: the back-off stays, nothing new to record
    adopt(watchdog, CarriedState(step=8, lr_scale=1.0, skipped=[(10, 14)]), tick=0, source="older")
    assert watchdog.lr_scale == 0.5 and len(Ledger(watchdog.ledger.path).load().entries) == 1
    # and what is carried out again is what was taken in (ticks since then added)
    assert carried_state(watchdog, step=20, tick=5) == CarriedState(
        step=20, lr_scale=0.5, skipped=[(10, 14)], position=14, rollbacks_ago=[55, 7]
    )
    assert carried_state(None, step=3, tick=3) == CarriedState(step=3)


def test_a_ledger_whose_adopt_entry_was_tampered_with_is_refused(tmp_path):
    watchdog = _watchdog(tmp_path)
    adopt(watchdog, CarriedState(step=12, lr_scale=0.5, skipped=[(10, 14)]), tick=0, source="x")
    doc = json.loads(watchdog.ledger.path.read_text())
    doc["skipped"] = [[10, 20]]  # a range no rollback and no adopted state made
    watchdog.ledger.path.write_text(json.dumps(doc))
    with pytest.raises(Exception, match="corrupt"):
        Ledger(watchdog.ledger.path).load()
    doc["skipped"], doc["entries"][0]["lr_scale"] = [[10, 14]], 2.0
    watchdog.ledger.path.write_text(json.dumps(doc))
    with pytest.raises(Exception, match="corrupt"):
        Ledger(watchdog.ledger.path).load()
