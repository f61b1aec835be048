"""Healthy checkpoints and the ledger in one process: round trips, refusals, write failures."""

from __future__ import annotations

import json
import logging
import random
import re
import resource
import shutil
import signal

import numpy as np
import pytest
import torch

from torchvitals.agent.recover.checkpoint import CheckpointError, CheckpointStore
from torchvitals.agent.recover.snapshot import Restored
from torchvitals.records.ledger import Ledger, LedgerError


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    # Dropout and the data below draw from the torch, Python and NumPy generators, so an exact
    # continuation needs all three restored.
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.Dropout(0.2), torch.nn.GELU(), torch.nn.Linear(128, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(8, 64)
        y = x[:, :1] * 2 + random.random() + float(np.random.rand())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def _snapshot(model, opt, sched) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "sched": sched.state_dict(),
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
    }


def _same(a, b) -> bool:
    if isinstance(a, (torch.Tensor, np.ndarray)):
        return bool((torch.as_tensor(a) == torch.as_tensor(b)).all()) and a.shape == b.shape
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.fixture
def saved(tmp_path):
    """A store holding checkpoints of steps 1 and 2 of one run; the run's state at step 1."""
    random.seed(0)
    np.random.seed(0)
    model, opt, sched = _setup()
    store = CheckpointStore(tmp_path / "ckpt")
    _train(model, opt, sched, 1)
    store.save(1, model, opt, sched, extra={"position": 1})
    step1 = _snapshot(model, opt, sched)
    _train(model, opt, sched, 1)
    store.save(2, model, opt, sched, extra={"position": 2})
    return store, step1


def test_round_trip_restores_everything_and_training_continues_identically(tmp_path):
    random.seed(0)
    np.random.seed(0)
    model, opt, sched = _setup()
    _train(model, opt, sched, 3)
    store = CheckpointStore(tmp_path)
    extra = {"position": 3, "skip": [[5, 7]], "history": {"loss": [2.5, 1.5]}, "lr_scale": 0.5}
    path = store.save(3, model, opt, sched, extra=extra)
    at_save = _snapshot(model, opt, sched)
    _train(model, opt, sched, 4)
    uninterrupted = _snapshot(model, opt, sched)

    model2, opt2, sched2 = _setup(seed=1)
    random.seed(1)
    np.random.seed(1)
    restored = store.load(model2, opt2, sched2)
    assert restored == Restored(step=3, path=path, extra=extra, rank_state=None, refused=[])
    assert _same(_snapshot(model2, opt2, sched2), at_save)
    _train(model2, opt2, sched2, 4)
    assert _same(_snapshot(model2, opt2, sched2), uninterrupted)
    assert store.last_save_seconds > 0
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(manifest) == [
        ".metadata",
        "__0_0.distcp",
        "plain-rank-00000.json",
        "rng-rank-00000.json",
        "state.json",
    ]
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest.values())


def test_keeps_the_last_k(tmp_path):
    model, opt, sched = _setup()
    store = CheckpointStore(tmp_path, keep=2)
    Ledger(tmp_path / "ledger.json").record_checkpoint(1, "x")
    for step in (1, 2, 3, 4):
        store.save(step, model, opt, sched)
    assert [p.name for p in store.list()] == ["step-00000003", "step-00000004"]
    assert store.latest() == tmp_path / "step-00000004"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ledger.json",
        "step-00000003",
        "step-00000004",
    ]


def test_a_step_saved_again_replaces_the_old_one(tmp_path):
    model, opt, sched = _setup()
    store = CheckpointStore(tmp_path)
    store.save(1, model, opt, sched, extra={"take": 1})
    _train(model, opt, sched, 1)
    store.save(1, model, opt, sched, extra={"take": 2})
    expected = _snapshot(model, opt, sched)
    model2, opt2, sched2 = _setup(seed=1)
    assert store.load(model2, opt2, sched2).extra == {"take": 2}
    assert _same(_snapshot(model2, opt2, sched2), expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def _flip_byte(folder):
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _append(folder):
    with open(folder / "state.json", "a") as f:
        f.write(" ")


@pytest.mark.parametrize(
    "damage,reason",
    [
        (_flip_byte, "__0_0.distcp: SHA-256 differs from the manifest"),
        (_append, "bytes, the manifest says"),
        (lambda f: (f / "rng-rank-00000.json").unlink(), "missing file rng-rank-00000.json"),
        (lambda f: (f / "notes.txt").write_text("hi"), "unexpected file notes.txt"),
        (lambda f: (f / "manifest.json").unlink(), "no manifest.json: a partial checkpoint"),
        (lambda f: (f / "manifest.json").write_text("{"), "manifest.json is unreadable"),
    ],
)
def test_a_damaged_checkpoint_is_refused_and_the_previous_one_used(saved, damage, reason, caplog):
    store, step1 = saved
    damage(store.root / "step-00000002")
    model, opt, sched = _setup(seed=1)
    with caplog.at_level(logging.WARNING, logger="torchvitals.agent.recover.checkpoint"):
        restored = store.load(model, opt, sched)
    assert restored.step == 1 and restored.extra == {"position": 1}
    [(folder, why)] = restored.refused
    assert folder.name == "step-00000002" and reason in why
    assert (
        "refusing checkpoint" in caplog.text
        and "step-00000002" in caplog.text
        and reason in caplog.text
    )
    assert _same(_snapshot(model, opt, sched), step1)
    with pytest.raises(
        CheckpointError, match=f"refusing checkpoint .*step-00000002: .*{reason[:12]}"
    ):
        store.load(model, opt, sched, path=store.root / "step-00000002")


def test_no_checkpoint_that_verifies_raises(saved):
    store, _ = saved
    for folder in store.list():
        (folder / "manifest.json").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint under .* verifies and loads .*step-00000002: no manifest",
    ):
        store.load(*_setup())
    with pytest.raises(CheckpointError, match="none was saved"):
        CheckpointStore(store.root / "empty").load(*_setup())


def test_a_save_interrupted_before_its_commit_is_ignored_then_cleaned(saved, caplog):
    store, _step1 = saved
    # What a crash between the manifest and the rename leaves: complete, but never committed.
    shutil.copytree(store.root / "step-00000001", store.root / ".tmp-step-00000003")
    model, opt, sched = _setup(seed=1)
    with caplog.at_level(logging.WARNING):
        assert store.load(model, opt, sched).step == 2
    assert ".tmp-step-00000003: a save that never committed" in caplog.text
    with pytest.raises(CheckpointError, match="not a committed checkpoint folder"):
        store.load(model, opt, sched, path=store.root / ".tmp-step-00000003")
    store.save(3, model, opt, sched)
    assert not list(store.root.glob(".tmp-*"))


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(saved):
    # RLIMIT_FSIZE makes writes past 40 kB fail with EFBIG, like ENOSPC on a full disk, and
    # unlike chmod it also stops root (CI runs as root). 40 kB lets the JSON files through and
    # stops the model shards inside DCP.
    store, _step1 = saved
    model, opt, sched = _setup(seed=1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, hard))
    try:
        with pytest.raises(CheckpointError) as error:
            store.save(3, model, opt, sched)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    message = str(error.value)
    assert "saving step 3" in message and "writing the model and optimizer shards" in message
    assert "DCP on rank 0: " in message and "bytes free there" in message
    assert "step-00000002) is untouched" in message
    assert [p.name for p in store.root.iterdir() if p.name.startswith(".tmp")] == []
    assert store.load(model, opt, sched).step == 2


def test_an_unwritable_root_fails_the_save_clearly(tmp_path):
    # A root that is a regular file cannot hold folders, for root as for anyone.
    (tmp_path / "file").write_text("")
    store = CheckpointStore(tmp_path / "file" / "ckpt")
    with pytest.raises(CheckpointError, match="failed while preparing: rank 0: NotADirectoryError"):
        store.save(1, *_setup())


def test_state_json_cannot_hold_is_refused_before_anything_is_written(saved):
    store, _ = saved
    model, opt, _ = _setup()

    class Warmup:  # a callable object: LambdaLR saves its __dict__
        def __init__(self):
            self.scale = torch.tensor(1.0)

        def __call__(self, step):
            return 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(opt, Warmup())
    with pytest.raises(
        CheckpointError,
        match=r"scheduler.state_dict\(\)\['lr_lambdas'\]\[0\]\['scale'\] holds a Tensor",
    ):
        store.save(3, model, opt, sched)
    with pytest.raises(CheckpointError, match=r"extra has the non-string key 5"):
        store.save(3, model, opt, extra={5: "x"})
    assert [p.name for p in store.list()] == ["step-00000001", "step-00000002"]
    assert not list(store.root.glob(".tmp-*"))


def test_ledger_round_trip(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = Ledger(path, clock=lambda: 1000.0).load()
    assert (ledger.lr_scale, ledger.skipped, ledger.entries, ledger.last_checkpoint) == (
        1.0,
        [],
        [],
        None,
    )
    ledger.record_checkpoint(100, tmp_path / "step-00000100")
    ledger.record_rollback(131, to_step=100, reason="loss spike", lr_scale=0.5, skipped=(100, 140))
    ledger.record_checkpoint(160, tmp_path / "step-00000160")
    ledger.record_rollback(
        171, to_step=160, reason="non-finite loss", lr_scale=0.25, skipped=(160, 175)
    )
    ledger.record_abort(190, "loop guard: 3 rollbacks in 100 steps")
    again = Ledger(path).load()
    assert again.to_dict() == ledger.to_dict()
    assert again.lr_scale == 0.25 and again.skipped == [(100, 140), (160, 175)]
    assert again.last_checkpoint == {
        "event": "checkpoint",
        "step": 160,
        "path": str(tmp_path / "step-00000160"),
        "time": 1000.0,
    }
    assert [again.is_skipped(i) for i in (99, 100, 139, 140, 174, 175)] == [
        False,
        True,
        True,
        False,
        True,
        False,
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.json"]  # no temporary file left
    reader = Ledger(tmp_path / "other.json", writer=False)
    reader.record_abort(1, "x")
    assert not (tmp_path / "other.json").exists()
    with pytest.raises(ValueError):
        ledger.record_rollback(200, to_step=160, reason="x", lr_scale=0.0, skipped=(160, 170))


@pytest.mark.parametrize(
    "content,why",
    [
        ('{"version": 1, "lr_scale": 0.5, "skipped": [[1, 2]], "entr', "JSONDecodeError"),
        ("\x00\x01garbage", "JSONDecodeError"),
        ("[]", "not a version-1 ledger"),
        (
            '{"version": 1, "lr_scale": -1, "skipped": [], "entries": []}',
            "lr_scale -1 is not in (0, 1]",
        ),
        # Sense, not only types: values a run could not have written.
        (
            '{"version": 1, "lr_scale": Infinity, "skipped": [], "entries": []}',
            "lr_scale inf is not in (0, 1]",
        ),
        (
            '{"version": 1, "lr_scale": 1e6, "skipped": [], "entries": []}',
            "lr_scale 1000000.0 is not in (0, 1]",
        ),
        (
            '{"version": 1, "lr_scale": 1, "skipped": [[0, 1000000000]], "entries": []}',
            "is not the ranges its rollbacks skipped",
        ),
        (
            '{"version": 1, "lr_scale": 1, "skipped": [], "entries": [{"event": "checkpoint", '
            '"step": 1000000000000, "path": "ckpt/step-00000040", "time": 0}]}',
            "entry 0 (checkpoint): path 'ckpt/step-00000040' is not the folder of step "
            "1000000000000",
        ),
        (
            '{"version": 1, "lr_scale": 0.5, "skipped": [], "entries": [{"event": "rollback", '
            '"step": 30, "to_step": 20, "reason": "x", "lr_scale": 0.5, "skipped": null, '
            '"time": 0}]}',
            "entry 0 (rollback): to_step 20 is not a checkpoint recorded before it",
        ),
        (
            '{"version": 1, "lr_scale": 0.5, "skipped": [[20, 1000000000]], "entries": ['
            '{"event": "checkpoint", "step": 20, "path": "c/step-00000020", "time": 0}, '
            '{"event": "rollback", "step": 27, "to_step": 20, "reason": "x", "lr_scale": 0.5, '
            '"skipped": [20, 1000000000], "from_position": 20, "position": 27, "margin": 2, '
            '"time": 1}]}',
            "skipped [20, 1000000000] is not what the rollback made of its positions",
        ),
        ('{"version": 1, "lr_scale": 1, "skipped": [[5, 2]], "entries": []}', "batch ranges"),
        (
            '{"version": 1, "lr_scale": 1, "skipped": [], '
            '"entries": [{"event": "rollback", "step": 3}]}',
            "entry 0 (rollback) has no valid 'to_step'",
        ),
    ],
)
def test_a_corrupt_ledger_is_refused_not_reset(tmp_path, content, why):
    path = tmp_path / "ledger.json"
    path.write_text(content)
    with pytest.raises(
        LedgerError, match=f"ledger .*ledger.json is corrupt .*{re.escape(why)}.*repair or remove"
    ):
        Ledger(path).load()
    assert path.read_text() == content
