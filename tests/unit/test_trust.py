"""A checkpoint folder cannot run code or hand a job another job's weights: the manifest is
signed, a load takes only what the ledger recorded, and nothing is unpickled."""

import json
import os
import pickle
import shutil

import pytest
import torch
from support.models import TINY, TinyGPT, random_batches

import torchvitals
from torchvitals.agent.recover.checkpoint import CheckpointError
from torchvitals.agent.recover.trust import CheckpointKey, SafeReader, UntrustedCheckpoint
from torchvitals.records.durable import sha256_file

BATCHES = list(random_batches(8, batch=2, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))


def run(ckpt, steps, **config):
    """Train ``steps`` steps under the watchdog (checkpoints at 2 and 4); the agent's resume."""
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = dict(
        checkpoint_dir=str(ckpt),
        checkpoint_every=2,
        healthy_window=0,
        snapshot_max_bytes=0,
        resume="auto",
    )
    agent = torchvitals.watch(model, opt, **{**settings, **config})
    resumed = agent.resumed_from
    for x, y in BATCHES[:steps]:
        loss = model.loss(x, y)
        loss.backward()
        agent.step(loss)
        opt.zero_grad(set_to_none=True)
    agent.close()
    return resumed, model


class Planted:
    """What an attacker's pickle would do: create a file when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def recompute_manifest(folder, keep_signature=True):
    """What anyone who can write the folder can do: fix every size and SHA-256."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"] = {
        n: {"size": s, "sha256": d} for n in manifest["files"] for s, d in [sha256_file(folder / n)]
    }
    if not keep_signature:
        manifest.pop("signature", None)
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def two_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    run(ckpt, 4)
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000002", "step-00000004"]
    return ckpt


@pytest.mark.parametrize("trust_unsigned", [False, True])
def test_a_planted_metadata_runs_no_code_and_the_job_resumes_from_the_last_trusted_one(
    two_checkpoints, tmp_path, caplog, trust_unsigned
):
    marker = tmp_path / "pwned"
    folder = two_checkpoints / "step-00000004"
    (folder / ".metadata").write_bytes(pickle.dumps(Planted(str(marker))))
    recompute_manifest(folder, keep_signature=False)
    resumed, _ = run(two_checkpoints, 0, trust_unsigned_checkpoints=trust_unsigned)
    assert not marker.exists(), "the planted pickle ran"
    assert resumed == 2
    # Refused by the signature, or (trusting unsigned folders) by the restricted unpickler.
    expected = "refused, not unpickled" if trust_unsigned else "unsigned"
    assert "refusing checkpoint" in caplog.text and expected in caplog.text, caplog.text


def test_a_forged_folder_the_ledger_never_recorded_is_never_loaded(two_checkpoints, caplog):
    forged = two_checkpoints / "step-99999999"
    shutil.copytree(two_checkpoints / "step-00000004", forged)  # a validly signed copy
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest["step"] = 99999999
    (forged / "manifest.json").write_text(json.dumps(manifest))
    resumed, _ = run(two_checkpoints, 0)
    assert resumed == 4
    assert "step-99999999: the ledger never recorded it" in caplog.text
    # Listed in the ledger by hand, it is still refused: its signature covers the step.
    ledger = json.loads((two_checkpoints / "ledger.json").read_text())
    ledger["entries"].append(
        {"event": "checkpoint", "step": 99999999, "path": str(forged), "time": 0.0}
    )
    (two_checkpoints / "ledger.json").write_text(json.dumps(ledger))
    resumed, _ = run(two_checkpoints, 0)
    assert resumed == 4 and "signature does not verify" in caplog.text


def test_a_checkpoint_of_another_key_is_refused_naming_the_fix(two_checkpoints, monkeypatch):
    monkeypatch.setenv("TORCHVITALS_CHECKPOINT_KEY", "another-job-" + "x" * 20)
    with pytest.raises(CheckpointError, match="signature does not verify") as e:
        run(two_checkpoints, 0)
    assert "TORCHVITALS_CHECKPOINT_KEY" in str(e.value) and len(str(e.value).splitlines()) <= 3
    resumed, _ = run(two_checkpoints, 0, trust_unsigned_checkpoints=True)
    assert resumed == 4


def test_a_load_that_fails_past_the_manifest_falls_back_to_the_previous_checkpoint(
    two_checkpoints, caplog
):
    """A shard whose bytes the job's own key vouched for but DCP cannot read (a truncated
    write on a flaky filesystem): a short reason, and the previous healthy checkpoint."""
    folder = two_checkpoints / "step-00000004"
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("signature")
    manifest["files"] = {
        n: {"size": s, "sha256": d} for n in manifest["files"] for s, d in [sha256_file(folder / n)]
    }
    manifest["signature"] = CheckpointKey.from_env().sign(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    resumed, _ = run(two_checkpoints, 0)
    assert resumed == 2
    (line,) = [
        r.getMessage()
        for r in caplog.records
        if "refusing checkpoint" in r.getMessage() and "step-00000004" in r.getMessage()
    ]
    assert "failed to load" in line and len(line) < 600 and "Traceback" not in line


def test_a_checkpoint_of_another_model_is_a_short_error(two_checkpoints):
    torch.manual_seed(0)
    other = TinyGPT(**{**TINY, "d_model": TINY["d_model"] * 2})
    opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError) as e:
        torchvitals.watch(other, opt, checkpoint_dir=str(two_checkpoints), resume="auto")
    message = str(e.value)
    assert "step-00000004" in message and "step-00000002" in message and "failed to load" in message
    assert len(message.splitlines()) <= 4, message
    assert "step" not in vars(opt), "the failed watch() left its guard behind"


def test_the_restricted_unpickler_builds_dcp_metadata_only(two_checkpoints, tmp_path):
    folder = two_checkpoints / "step-00000004"
    metadata = SafeReader(folder).read_metadata()  # the real one reads
    assert type(metadata).__name__ == "Metadata"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(Planted(str(tmp_path / "pwned"))))
    with pytest.raises(UntrustedCheckpoint, match=r"io.open.*refused, not unpickled"):
        SafeReader(evil).read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_the_default_key_is_made_once_per_user_private(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHVITALS_CHECKPOINT_KEY", raising=False)
    monkeypatch.delenv("TORCHVITALS_CHECKPOINT_KEY_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    first = CheckpointKey.from_env()
    path = tmp_path / ".config" / "torchvitals" / "checkpoint.key"
    assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
    assert CheckpointKey.from_env().sign({"step": 1}) == first.sign({"step": 1})
    with pytest.raises(ValueError, match=r"checkpoint_key_file .*cannot be read"):
        CheckpointKey.from_env(key_file=str(tmp_path / "missing.key"))
    short = tmp_path / "short.key"
    short.write_text("abc")
    with pytest.raises(ValueError, match="at least 16"):
        CheckpointKey.from_env(key_file=str(short))
    assert os.listdir(path.parent) == ["checkpoint.key"], "a temporary key file was left"
