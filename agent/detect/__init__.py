"""Stage 2, detect: named failure patterns from the reduced reports, the same on every rank.

``verdict`` (a leaf) spells every pattern and severity once; ``thresholds`` holds every number
a rule compares against; ``rules`` are the fingerprints, one small class each (``rules_vitals``
memory, data and replicas; ``straggler`` the slow rank, judged by itself); ``detector`` runs
them and keeps what is active; ``wiring`` finds frozen or unoptimized parameters before the
first step. May import ``..measure`` (block kinds), ``..report``, ``..config``; nothing from
recover or outputs. Pure Python but for ``wiring``: no torch on the per-step path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_exports

_EXPORTS = {
    "Detector": ".detector",
    "Thresholds": ".thresholds",
    "Verdict": ".verdict",
    "PATTERNS": ".verdict",
    "SEVERITIES": ".verdict",
    "INFO": ".verdict",
    "WARNING": ".verdict",
    "CRITICAL": ".verdict",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # `import X as X`: re-exported for type checkers (PEP 484)
    from .detector import Detector as Detector
    from .thresholds import Thresholds as Thresholds
    from .verdict import CRITICAL as CRITICAL
    from .verdict import INFO as INFO
    from .verdict import PATTERNS as PATTERNS
    from .verdict import SEVERITIES as SEVERITIES
    from .verdict import WARNING as WARNING
    from .verdict import Verdict as Verdict

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
