"""Runs examples/torchtitan_train.py as torchrun would, on the CPU harness: torchtitan's config
parser returns the harness's debug llama3 (a synthetic loader cannot be named by a flag).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/integration/titan_example_job.py OUT STEPS
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import titan_harness  # noqa: E402  (first: the CPU harness)
from torchtitan.config import ConfigManager  # noqa: E402

out, steps = Path(sys.argv[1]), int(sys.argv[2])
ConfigManager.parse_args = lambda self, args=None: titan_harness.debug_llama3(out, steps=steps)
sys.argv = [str(HERE.parents[1] / "examples" / "torchtitan_train.py")]
runpy.run_path(sys.argv[0], run_name="__main__")
