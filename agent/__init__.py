"""The per-rank agent: one training step's pipeline, a stage per folder.

    agent = torchvitals.watch(model, optimizer, scheduler)     # agent.Agent
    report = agent.step(loss)                                  # report.Report

``agent.py`` builds a rank's agent at ``watch()`` from named collaborators; ``guard.py`` routes
the optimizer's own ``step()`` to it (``patches/`` installs and undoes every patch of torch,
``compat/`` reads torch's and each framework's private names, ``backends/`` is one optimizer
backend per kind, chosen once); ``step.py`` runs each step top to bottom: ``measure/``
(what the rank sees, reduced across ranks) -> ``detect/`` (what it means) -> ``recover/`` (what
the watchdog does about it) -> ``outputs/`` (who hears of it). ``signals/`` holds each vital
sign as a vertical slice across those stages (what it packs, how it reads back, the rules and
metrics it feeds). ``config.py`` is its settings and ``report.py`` the plain data it returns.
``tools/`` are offline commands and ``integrations/`` the framework callbacks, built on the same
pieces. A stage imports only the stages before it (and ``config``, ``report``, ``compat``,
``backends``, the package's ``protocol``/``settings``/``errors``); only ``agent.py``,
``step.py`` and ``signals/`` see them all. The names load on first use: importing this package
alone imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_EXPORTS = {"Agent": ".agent", "watch": ".agent", "Config": ".config", "Report": ".report"}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # `import X as X`: re-exported for type checkers (PEP 484)
    from .agent import Agent as Agent
    from .agent import watch as watch
    from .config import Config as Config
    from .report import Report as Report

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
