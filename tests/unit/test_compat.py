"""The torch versions torchvitals accepts: pyproject's range, compat's refusal, CI's pins, one
truth.

    python -m pytest tests/unit/test_compat.py
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
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
