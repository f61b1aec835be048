"""The per-rank agent: exact per-block vital signs, one packed reduction, Prometheus exposition.

``Agent``, ``watch``, ``Config`` and ``Report`` load on first use: the collector imports
``agent.config`` and ``agent.durable`` (no torch) without pulling in the training side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"Agent": ".agent", "watch": ".agent", "Config": ".config", "Report": ".report"}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .agent import Agent, watch
    from .config import Config
    from .report import Report


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
