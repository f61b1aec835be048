"""docker/collector-requirements.py: what the collector's image (and .ci/run's torch-free venvs)
install, read from pyproject.toml.

    python -m pytest tests/deploy/test_collector_requirements.py

That the list suffices is proven where it is installed: .ci/run runs the collector's tests on
Python 3.10 and 3.13 in venvs holding only it (``bash .ci/run pythons``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0]


def test_the_collector_gets_the_dependencies_without_the_training_sides_plus_its_extra():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "docker" / "collector-requirements.py"),
            str(ROOT / "pyproject.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    training = {"torch", "rich", "matplotlib"}
    assert training <= {_name(d) for d in project["dependencies"]}
    assert out.stdout.splitlines() == (
        [d for d in project["dependencies"] if _name(d) not in training]
        + project["optional-dependencies"]["collector"]
    )
    assert {"starlette", "uvicorn", "prometheus-client"} <= set(map(_name, out.stdout.split()))
