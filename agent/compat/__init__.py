"""Every private torch and framework name torchvitals reads or writes, one module per framework,
each checked.

    from torchvitals.agent import compat
    compat.check()          # raises CompatError naming each missing name and the torch version

torchvitals leans on names torch and the frameworks do not promise to keep. Every other module
reaches them through this package (``tests/unit/test_layout.py`` holds them to it), so an
upgrade that renames one fails ``check()`` in one unit test, with the name, instead of
misbehaving at run time:

    versions.py     the torch floor (``MIN_TORCH``), ``CompatError``, refusing an old torch
    pytorch.py      torch's: the scaler, the LR schedulers' markers, clipping, foreach kernels,
                    the state-dict helpers, the pipeline schedule's loss
    wrapped.py      the module a wrapper holds, the prefixes wrappers add, a parameter's size
    dcp.py          the globals a DCP ``.metadata`` pickle may name
    accelerate.py   accelerate's optimizer overflow flag
    deepspeed.py    DeepSpeed's ZeRO-1/2/3 optimizers and its engine's clipping
    torchtitan.py   torchtitan's CheckpointManager

At import, a torch older than ``MIN_TORCH`` (pyproject.toml's floor) raises ``CompatError``
naming the version and the supported range, and so does a name a module binds directly (a
function, a class) that is missing: ``torchvitals.watch`` imports this package, so an
unsupported torch is refused there, before the first step, never a crash mid-run. A torch newer
than the series .ci/run tests only warns, since the names may well still hold. Each module's
``problems()`` checks what cannot be bound at import (instance attributes, calls inside torch's
source); a framework that is not installed has nothing to check.
"""

from __future__ import annotations

import torch

from . import accelerate, dcp, deepspeed, pytorch, torchtitan, versions, wrapped
from .versions import (
    MIN_TORCH,
    SUPPORTED_TORCH,
    TESTED_TORCH,
    CompatError,
    supported_range,
    too_old,
    torch_series,
)

__all__ = [
    "MIN_TORCH",
    "SUPPORTED_TORCH",
    "TESTED_TORCH",
    "CompatError",
    "check",
    "problems",
    "supported_range",
    "too_old",
    "torch_series",
]

MODULES = (versions, pytorch, wrapped, dcp, accelerate, deepspeed, torchtitan)
"""Each module with private names, in the order ``problems()`` reports them."""


def problems() -> list[str]:
    """Each private name that does not hold in the installed torch (and frameworks, those that
    are installed), as a sentence naming it; empty when all hold."""
    return [found for module in MODULES for found in module.problems()]


def check() -> None:
    """Raise ``CompatError`` when this torch is older than ``MIN_TORCH`` or any private name
    does not hold (see ``problems``); the message names the torch version and the supported
    range. A newer torch whose names all hold passes (its import warned that it is untested).

    Costs a few seconds (it builds small objects, saves a tiny DCP checkpoint and reads torch's
    and the installed frameworks' source): run it once, in a test or before a long job, not
    per step.
    """
    found = problems()
    if found:
        raise CompatError(
            f"torchvitals cannot run on torch {torch.__version__} (it supports "
            f"{supported_range()}):\n  " + "\n  ".join(found)
        )
