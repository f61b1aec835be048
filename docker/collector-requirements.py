"""Print the package's dependencies without torch: what the collector image installs.

    python docker/collector-requirements.py pyproject.toml > requirements.txt

The collector and the supervisor import no torch (tests/unit/test_imports.py), so their image
skips the one dependency that weighs gigabytes; the rest comes from pyproject.toml, never a copy.
"""

import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    dependencies = tomllib.load(f)["project"]["dependencies"]
print("\n".join(d for d in dependencies if re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] != "torch"))
