"""What the rules see beside the Report: rank-identical signals that are not report fields."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Observed:
    """The step's other inputs to detection, filled by the signals and the agent.

    Every field is derived from the reduced vector (or from calls every rank makes), so it is
    identical on every rank.
    """

    straggler_flags: list[float] | None = None
    """The summed straggler flags (``detect/straggler.py``); None when none were packed."""
    validation: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    """Validation losses reported since the last step, ``(step, mean over ranks)``."""
    directive: float = 0.0
    """The collector directive code global rank 0 polled (0: none)."""
    repeated: tuple[int, list[int]] = (0, [])
    """How many ranks stepped twice on the same gradients, and which (one or two named: see
    ``measure/ranksum.py``)."""
    custom: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Name -> value of the user's own signals that only the rules read (``report.custom``
    holds what the sinks should see too)."""
