"""accelerate's private names torchvitals reads or writes: its optimizer's overflow flag.

    if accelerate_overflow(optimizer): clear_accelerate_overflow(optimizer)

The Hugging Face Trainer runs through accelerate, whose ``AcceleratedOptimizer`` marks a step
that fp16's overflow skipped; the Trainer then leaves its scheduler alone. ``problems()`` checks
that the installed accelerate still sets that flag (nothing to check when none is installed).
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

OVERFLOW = "_is_overflow"
"""``AcceleratedOptimizer``'s flag: its last step was an fp16 overflow, skipped."""


def accelerate_overflow(optimizer: Any) -> bool:
    """Whether accelerate's ``AcceleratedOptimizer`` marked its last step an fp16 overflow (it
    then leaves the Trainer's scheduler alone)."""
    return bool(getattr(optimizer, OVERFLOW, False))


def clear_accelerate_overflow(optimizer: Any) -> None:
    """Unmark it: the Trainer then steps its scheduler as after any real step."""
    optimizer._is_overflow = False


def problems() -> list[str]:
    """The flag above, when the installed accelerate no longer sets it; empty without one."""
    if importlib.util.find_spec("accelerate") is None:
        return []
    # Imported here, not at the top: accelerate is optional, and slow to import.
    from accelerate.optimizer import AcceleratedOptimizer

    if f"self.{OVERFLOW}" not in inspect.getsource(AcceleratedOptimizer):
        return [f"accelerate.optimizer.AcceleratedOptimizer.{OVERFLOW} is gone"]
    return []
