"""Installing torchvitals keeps the user's torch, and the wheel carries what a user expects.

    python -m pytest tests/integration/test_install.py

The wheel is built from the checkout, offline; pip then resolves it, offline, into venvs whose
torch (and every other dependency) is a bare dist-info: the torch of an NGC image
(``2.13.0a0+git...``, which ``torch>=2.13,<2.14`` refused, so pip replaced that CUDA build), a
newer release, and an older one, which pip must want to replace.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
PACKAGES = sorted(
    {p.split(".")[1] for p in PYPROJECT["tool"]["setuptools"]["packages"] if "." in p}
)
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "py.typed", *PACKAGES)
"""What the wheel is built from besides the top-level modules: the top-level folders of the
packages pyproject lists, read from it (a new package is never left out)."""

pytestmark = pytest.mark.slow  # a wheel build and three pip resolutions: 16-22 s on 2 cores


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The torchvitals wheel, built offline from a copy of the checkout (the build's own
    ``build/`` and egg-info then never land in the working tree)."""
    src = tmp_path_factory.mktemp("src")
    for path in [*ROOT.glob("*.py"), *(ROOT / name for name in SOURCES)]:
        if path.is_dir():
            shutil.copytree(
                path, src / path.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(path, src / path.name)
    out = tmp_path_factory.mktemp("wheelhouse")
    # --no-build-isolation: setuptools comes from this environment (the dev extra), not the
    # network.
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    [found] = out.glob("torchvitals-*.whl")
    return found


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        [name] = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return HeaderParser().parsestr(z.read(name).decode())


def test_the_wheel_ships_py_typed_the_license_and_its_metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert "torchvitals/py.typed" in names
    [license_] = [n for n in names if re.search(r"\.dist-info/(licenses/)?LICENSE$", n)]
    with zipfile.ZipFile(wheel) as z:
        assert "Apache License" in z.read(license_).decode()[:200]
    meta = metadata(wheel)
    assert meta["Version"] == PROJECT["version"] and meta["Requires-Python"] == ">=3.10"
    # PEP 639: the SPDX expression, which supersedes the License :: classifiers.
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License-File"] == "LICENSE"
    classifiers = meta.get_all("Classifier")
    assert "Typing :: Typed" in classifiers
    # The Pythons classified are the ones from the floor up to the highest .ci/run tests.
    pythons = sorted(
        (
            c.rsplit(":: ", 1)[1]
            for c in classifiers
            if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
        ),
        key=lambda v: int(v.split(".")[1]),
    )
    assert pythons == ["3.10", "3.11", "3.12", "3.13"]
    requires = meta.get_all("Requires-Dist")
    assert "torch>=2.13.0a0" in requires
    # The collector's web stack is an extra: a training job never installs it.
    web = [r for r in requires if r.startswith(("starlette", "uvicorn"))]
    assert len(web) == 2 and all('extra == "collector"' in r for r in web), web


def _fake_dist(site: Path, name: str, version: str) -> None:
    """A bare ``.dist-info``: how pip sees an installed distribution (no files, no deps)."""
    folder = site / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (folder / "INSTALLER").write_text("pip\n")
    (folder / "RECORD").write_text(
        "".join(f"{folder.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD"))
    )


def _env_with(tmp_path: Path, wheel: Path, torch: str) -> Path:
    """A venv (no pip, no system site-packages) whose torch is ``torch`` and whose other
    dependencies are there at their lowest admitted version; returns its python."""
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    )
    _fake_dist(site, "torch", torch)
    for requirement in metadata(wheel).get_all("Requires-Dist"):
        if "extra ==" in requirement or requirement.startswith("torch"):
            continue
        found = re.fullmatch(r"([A-Za-z0-9._-]+)>=([0-9][0-9.]*)", requirement)
        assert found, f"{requirement}: give it a plain >= lower bound, or teach this test"
        _fake_dist(site, *found.groups())
    return python


def _dry_run(python: Path, wheel: Path, report: Path) -> subprocess.CompletedProcess:
    # This environment's pip resolves for the venv's interpreter (--python), offline and
    # without the machine's pip configuration (its find-links hold torch wheels): the only
    # distribution it can find is the torchvitals wheel, so any other install is a failure.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--dry-run",
            "--no-index",
            "--find-links",
            str(wheel.parent),
            "--report",
            str(report),
            "--quiet",
            "--disable-pip-version-check",
            "torchvitals",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize("torch", ["2.13.0a0+gitabc1234", "2.14.1+cu130"])
def test_pip_keeps_the_torch_that_is_installed(tmp_path, wheel, torch):
    python = _env_with(tmp_path, wheel, torch)
    done = _dry_run(python, wheel, tmp_path / "report.json")
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert [item["metadata"]["name"] for item in report["install"]] == ["torchvitals"]


def test_pip_wants_another_torch_only_below_the_floor(tmp_path, wheel):
    """The control: the same resolution with a torch older than the floor must ask for a
    torch (there is none to find offline), so the test above can fail."""
    python = _env_with(tmp_path, wheel, "2.12.1")
    done = _dry_run(python, wheel, tmp_path / "report.json")
    assert done.returncode != 0
    assert "requirement torch>=2.13.0a0 (from torchvitals)" in done.stderr, done.stderr
