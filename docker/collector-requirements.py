"""Print what the collector's image installs: the package's dependencies without the training
side's, plus the ``collector`` extra.

    python docker/collector-requirements.py pyproject.toml > requirements.txt

The collector and the supervisor import neither torch (the one dependency that weighs
gigabytes) nor the demo's live view and plots (rich, matplotlib): tests/integration/
test_imports.py holds them to it. The rest comes from pyproject.toml, never a copy. .ci/run
installs the same list into the torch-free venvs of the other Pythons.
"""

import re
import sys

import tomllib

TRAINING_ONLY = {"torch", "rich", "matplotlib"}
"""Dependencies only the training side imports: torch, the live view (rich), the report's
plots (matplotlib)."""

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
wanted = [
    d
    for d in project["dependencies"]
    if re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] not in TRAINING_ONLY
]
print("\n".join(wanted + project["optional-dependencies"]["collector"]))
