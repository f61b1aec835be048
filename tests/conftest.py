"""Shared test set-up: tests never bind the default metrics port or write into the repository."""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, os.path.join(ROOT, "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

# Children spawned by the distributed tests inherit these; a test that wants a port or a log
# passes it explicitly.
os.environ["TORCHVITALS_METRICS_PORT"] = "0"
os.environ["TORCHVITALS_LOG_DIR"] = ""
# One checkpoint key for the session (spawned ranks and supervised jobs inherit it), so tests
# never write a key into the user's ~/.config; the tests of the default key file set HOME.
os.environ.setdefault("TORCHVITALS_CHECKPOINT_KEY", __import__("secrets").token_hex(32))


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the models are tiny, reductions stay deterministic, and CI's two
    cores are shared with the spawned ranks."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
