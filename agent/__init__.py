"""The per-rank agent: exact per-block vital signs, one packed reduction, Prometheus exposition.

``Agent``, ``watch``, ``Config`` and ``Report`` load on first use: the collector imports
``agent.config`` and ``agent.durable`` (no torch) without pulling in the training side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports

_EXPORTS = {"Agent": ".agent", "watch": ".agent", "Config": ".config", "Report": ".report"}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .agent import Agent, watch
    from .config import Config
    from .report import Report

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
