"""Shared test set-up: tiers by folder, and tests never bind the default metrics port or write
into the repository.

Each folder under tests/ is a tier and marks its tests (``-m unit``, ``-m "not slow"``, ...;
the markers are registered in pyproject.toml). A file whose tests also belong elsewhere marks
them itself (``frameworks``, ``distributed``, ``slow``, ``cuda``).

``TORCHVITALS_TESTS_WITHOUT_TORCH=1`` runs only the files of ``TORCH_FREE``, with torch blocked:
what .ci/run does on the lowest and the highest Python the project claims, in venvs that hold no
torch. Without it nothing is left out, and a missing torch fails at once (the import below).
"""

import importlib.abc
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TORCH_FREE = frozenset(
    {
        "unit/test_collector_config.py",
        "unit/test_config.py",
        "unit/test_diagnose.py",
        "unit/test_diagnose_culprit.py",
        "unit/test_backtest.py",
        "unit/test_backtest_curves.py",
        "unit/test_backtest_logs.py",
        "unit/test_eventlog.py",
        "unit/test_goodput.py",
        "unit/test_disruption_costs.py",
        "unit/test_goodput_export.py",
        "unit/test_incidents.py",
        "unit/test_records.py",
        "unit/test_launcher_log.py",
        "unit/test_death_marks.py",
        "unit/test_heartbeat_ages.py",
        "unit/test_blame.py",
        "unit/test_restart_bound.py",
        "unit/test_rfc3339.py",
        "unit/test_supervisor_unit.py",
        "unit/test_tiers.py",
        "unit/test_worker_groups.py",
        "integration/test_collector_bounds.py",
        "integration/test_collector_restart.py",
        "integration/test_collector_tokens.py",
        "integration/test_collector_webhook.py",
        "integration/test_supervisor_findings.py",
        "integration/test_incident_commands.py",
        "integration/test_incident_race.py",
    }
)
"""Test files (under tests/) that need no torch, nor a process that imports it: the collector's,
and the unit tests of the torch-free modules. A file listed here that imports torch fails the
torch-free run at collection, never a silent skip."""
WITHOUT_TORCH = os.environ.get("TORCHVITALS_TESTS_WITHOUT_TORCH") == "1"


class _NoTorch(importlib.abc.MetaPathFinder):
    """Refuses ``import torch``, so a torch-free run proves it also where torch is installed."""

    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(
                f"{name}: blocked (TORCHVITALS_TESTS_WITHOUT_TORCH=1 runs the "
                "torch-free tests only; list a file in tests/conftest.py "
                "TORCH_FREE only if it needs no torch)"
            )
        return None


if WITHOUT_TORCH:
    sys.meta_path.insert(0, _NoTorch())
    torch = None
else:
    import torch

# The support package (shared models and harness). Spawned ranks inherit this sys.path; scripts
# a test starts with torchrun insert tests/ themselves. Never examples/: tests import nothing
# from there.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

TIERS = {
    "unit": "unit",
    "distributed": "distributed",
    "integration": "integration",
    "scenarios": "scenarios",
    "deploy": "deploy",
    "multinode": "multinode",
}
"""Folder -> the marker every test in it carries."""

# Children spawned by the distributed tests inherit these; a test that wants a port or a log
# passes it explicitly.
os.environ["TORCHVITALS_METRICS_PORT"] = "0"
os.environ["TORCHVITALS_LOG_DIR"] = ""
# One checkpoint key for the session (spawned ranks and supervised jobs inherit it), so tests
# never write a key into the user's ~/.config; the tests of the default key file set HOME.
os.environ.setdefault("TORCHVITALS_CHECKPOINT_KEY", __import__("secrets").token_hex(32))


def pytest_configure(config: pytest.Config) -> None:
    """A stale ``TORCH_FREE`` entry is an error: the torch-free run would quietly shrink."""
    missing = sorted(name for name in TORCH_FREE if not (HERE / name).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py TORCH_FREE names missing files: {missing}")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """In a torch-free run, every test file outside ``TORCH_FREE`` is left out (None: pytest's
    own rules decide)."""
    if (
        not WITHOUT_TORCH
        or collection_path.suffix != ".py"
        or not collection_path.name.startswith("test_")
    ):
        return None
    return collection_path.resolve().relative_to(HERE).as_posix() not in TORCH_FREE or None


LONGEST_FIRST = frozenset({"multinode", "slow"})
"""Under pytest-xdist (``-n 2``, what .ci/run runs) the tests carrying one of these marks start
first: the workers share out the long ones early and end on the short ones, instead of one
worker finishing a 90 s test alone while the other waits."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its folder's tier (a test outside every tier is an error); across
    xdist workers, the longest tests first (``LONGEST_FIRST``; the order is otherwise kept)."""
    for item in items:
        folder = item.path.resolve().relative_to(HERE).parts[0]
        if folder not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: every test lives in a tier folder "
                f"({', '.join(sorted(TIERS))}) under tests/"
            )
        item.add_marker(TIERS[folder])
    if os.environ.get("PYTEST_XDIST_WORKER"):  # set in each worker, whose collection is scheduled
        items.sort(key=lambda item: not any(item.get_closest_marker(m) for m in LONGEST_FIRST))


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the models are tiny, reductions stay deterministic, and CI's two
    cores are shared with the spawned ranks."""
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
