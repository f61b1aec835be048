"""The private names of torch and the frameworks, one compat module each, and the torch
versions torchvitals accepts: pyproject's range, compat's refusal, CI's pins, one truth.

    python -m pytest tests/unit/test_compat.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import torch

from torchvitals.agent import compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "version",
    [
        "2.13.0a0+git1a2b3c4",  # NGC and vendor images
        "2.13.0",
        "2.13.0+cpu",
        "2.13.1+cu128",
        "2.14.1+cu130",
        "2.15.0.dev20270101",
        "3.0.0",
    ],
)
def test_every_torch_from_the_floor_up_is_accepted(version):
    assert compat.too_old(version) is None


@pytest.mark.parametrize("version", ["2.12.1", "2.12.1+cu126", "2.13.0.dev20260101", "1.13.1"])
def test_an_older_torch_is_refused_naming_it_and_the_range(version):
    reason = compat.too_old(version)
    assert reason is not None
    assert f"torch {version} is older" in reason
    assert "torch>=2.13.0a0" in reason and "tested: 2.13.x, 2.14.x" in reason


def test_check_refuses_an_older_torch_with_the_version_and_the_range(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.12.1+cu126")
    with pytest.raises(compat.CompatError) as info:
        compat.check()
    message = str(info.value)
    assert message.startswith(
        "torchvitals cannot run on torch 2.12.1+cu126 (it supports "
        "torch>=2.13.0a0 (tested: 2.13.x, 2.14.x)):"
    )
    assert "torch 2.12.1+cu126 is older than torchvitals supports" in message


def test_the_range_is_pyprojects_and_ci_pins_every_tested_series():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(r"torch\b", d)]
    assert spec == f"torch>={compat.MIN_TORCH}"  # no upper bound
    assert compat.torch_series(compat.MIN_TORCH) == compat.SUPPORTED_TORCH == compat.TESTED_TORCH[0]
    pins = set(re.findall(r"torch==(\d+\.\d+)\.\d+", (ROOT / ".ci" / "run").read_text()))
    assert pins == set(compat.TESTED_TORCH)


# ---------------------------------------------------------------- one module per framework


@pytest.mark.parametrize("module", compat.MODULES, ids=lambda m: m.__name__.rpartition(".")[2])
def test_each_modules_private_names_hold_on_this_install(module):
    """What CI runs against: a torch (or installed framework) that renamed one fails here."""
    assert module.problems() == []


def test_check_names_a_problem_of_any_module(monkeypatch):
    monkeypatch.setattr(compat.deepspeed, "problems", lambda: ["deepspeed.x is gone"])
    monkeypatch.setattr(compat.dcp, "problems", lambda: ["dcp.y is gone"])
    with pytest.raises(compat.CompatError) as info:
        compat.check()
    assert str(info.value).endswith(":\n  dcp.y is gone\n  deepspeed.x is gone")


def test_a_dcp_metadata_global_missing_from_the_table_is_named(monkeypatch):
    key = ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")
    monkeypatch.delitem(compat.dcp.DCP_METADATA_GLOBALS, key)
    [problem] = compat.dcp.problems()
    assert "torch.distributed.checkpoint.metadata.TensorStorageMetadata" in problem
    assert "recover/trust.py" in problem


def test_the_wrapped_module_and_the_whole_size_of_a_parameter():
    inner = torch.nn.Linear(2, 3)
    ddp_like = torch.nn.Module()
    ddp_like.module = inner
    assert compat.wrapped.wrapped_module(ddp_like) is inner
    assert compat.wrapped.wrapped_module(inner) is None
    assert compat.wrapped.full_numel(inner.weight) == 6
    partitioned = torch.nn.Parameter(torch.empty(0))
    partitioned.ds_numel = 10  # a ZeRO-3 parameter outside forward: numel() is 0
    assert compat.wrapped.full_numel(partitioned) == 10


def test_accelerates_overflow_flag_is_read_and_cleared():
    class Accelerated:
        _is_overflow = True

    opt = Accelerated()
    assert compat.accelerate.accelerate_overflow(opt)
    compat.accelerate.clear_accelerate_overflow(opt)
    assert not compat.accelerate.accelerate_overflow(opt)
    assert not compat.accelerate.accelerate_overflow(object())


def test_torchtitans_checkpoint_to_load_asks_its_manager():
    class Manager:
        def __init__(self, newest):
            self.newest = newest

        def _find_load_step(self):
            return self.newest

        def _create_checkpoint_id(self, step):
            return f"/ckpt/step-{step}"

    to_load = compat.torchtitan.titan_checkpoint_to_load
    assert to_load(Manager(120)) == (120, "/ckpt/step-120")
    assert to_load(Manager(120), step=40) == (40, "/ckpt/step-40")
    assert to_load(Manager(-1)) == (-1, None)
    with pytest.raises(compat.CompatError, match=r"CheckpointManager\._find_load_step"):
        to_load(object())


def test_deepspeeds_kind_tests_look_at_the_object_alone():
    ds = compat.deepspeed
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert not ds.is_zero_optimizer(opt) and not ds.is_zero3_optimizer(opt)
    assert not ds.is_deepspeed(opt)
    zero = type("DeepSpeedZeroOptimizer", (), {"__module__": ds.ZERO_MODULE})()
    assert not ds.is_zero_optimizer(zero)  # the module alone is not enough
    zero.averaged_gradients, zero.bit16_groups = {}, [[]]
    assert ds.is_zero_optimizer(zero) and ds.is_deepspeed(zero)
    assert not ds.is_zero3_optimizer(zero)
    assert ds.zero_grad_fragment(torch.nn.Parameter(torch.zeros(1))) is None
