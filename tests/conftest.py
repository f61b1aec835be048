"""Shared test set-up: tiers by folder, and tests never bind the default metrics port or write
into the repository.

Each folder under tests/ is a tier and marks its tests (``-m unit``, ``-m "not slow"``, ...;
the markers are registered in pyproject.toml). A file whose tests also belong elsewhere marks
them itself (``frameworks``, ``distributed``, ``slow``, ``cuda``).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
# The support package (shared models and harness). Spawned ranks inherit this sys.path; scripts
# a test starts with torchrun insert tests/ themselves. Never examples/: tests import nothing
# from there.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

TIERS = {"unit": "unit", "distributed": "distributed", "integration": "integration",
         "scenarios": "scenarios", "deploy": "deploy", "multinode": "multinode"}
"""Folder -> the marker every test in it carries."""

# Children spawned by the distributed tests inherit these; a test that wants a port or a log
# passes it explicitly.
os.environ["TORCHVITALS_METRICS_PORT"] = "0"
os.environ["TORCHVITALS_LOG_DIR"] = ""
# One checkpoint key for the session (spawned ranks and supervised jobs inherit it), so tests
# never write a key into the user's ~/.config; the tests of the default key file set HOME.
os.environ.setdefault("TORCHVITALS_CHECKPOINT_KEY", __import__("secrets").token_hex(32))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its folder's tier; a test outside every tier is an error."""
    for item in items:
        folder = item.path.resolve().relative_to(HERE).parts[0]
        if folder not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in a tier folder "
                                    f"({', '.join(sorted(TIERS))}) under tests/")
        item.add_marker(TIERS[folder])


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the models are tiny, reductions stay deterministic, and CI's two
    cores are shared with the spawned ranks."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
