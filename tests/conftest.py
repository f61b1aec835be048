"""Shared test set-up: tests never bind the default metrics port or write into the repository."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, os.path.join(ROOT, "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

# Children spawned by the distributed tests inherit these; a test that wants a port or a log
# passes it explicitly.
os.environ["TORCHVITALS_METRICS_PORT"] = "0"
os.environ["TORCHVITALS_LOG_DIR"] = ""
