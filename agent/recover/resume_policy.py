"""Whether a checkpoint folder that already holds a run may be continued by this process.

    ResumePolicy("restart").check(latest, ledger)    # raises ResumeRefused, or returns

``Config.resume``: "auto" always continues it; "never" always refuses it; "restart" continues
it only in a restarted process (``torchvitals supervise``'s later attempts, torchrun's
``--max-restarts``), so a new run pointed at an old folder is an error, never silently another
run's continuation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import TorchvitalsError
from ...protocol import ATTEMPT_ENV
from ...records.ledger import Ledger

MODES = ("restart", "auto", "never")


class ResumeRefused(TorchvitalsError, RuntimeError):
    """The checkpoint folder holds a run that this process was not told to continue."""


def restarted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a restart: by ``torchvitals supervise`` (attempt > 1) or by
    torchrun's ``--max-restarts`` (``TORCHELASTIC_RESTART_COUNT`` > 0)."""
    environ = os.environ if environ is None else environ
    try:
        return (
            int(environ.get(ATTEMPT_ENV, "1")) > 1
            or int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        )
    except ValueError:
        return False


@dataclass(frozen=True)
class ResumePolicy:
    """``Config.resume`` applied to a folder that holds checkpoints."""

    mode: str = "restart"
    """"restart", "auto" or "never" (see the module)."""
    environ: Mapping[str, str] | None = None
    """Where ``restarted`` looks (None: ``os.environ`` when asked)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"resume must be 'restart', 'auto' or 'never', got {self.mode!r}")

    def continues(self) -> bool:
        """Whether a folder that holds a run is continued."""
        return self.mode == "auto" or (self.mode == "restart" and restarted(self.environ))

    def check(self, latest: Path, ledger: Ledger, checkpoint_dir: Any = None) -> None:
        """Return if the run in the folder may be continued.

        Args:
            latest: its newest committed checkpoint.
            ledger: its ledger (for the message).
            checkpoint_dir: the folder as configured (for the message; default: ``latest``'s).

        Raises:
            ResumeRefused: it may not; the message says how to continue it or start afresh.
        """
        if self.continues():
            return
        folder = latest.parent if checkpoint_dir is None else checkpoint_dir
        rollbacks = sum(e["event"] == "rollback" for e in ledger.entries)
        raise ResumeRefused(
            f"checkpoint_dir {folder} already holds a run (latest {latest.name}, learning-rate "
            f"scale {ledger.lr_scale:g}, {rollbacks} rollbacks in {ledger.path}). A new run "
            f'would silently continue it: pass resume="auto" (or TORCHVITALS_RESUME=auto) to '
            f"continue it, or use a new checkpoint_dir. (resume={self.mode!r}; torchvitals "
            f"supervise and torchrun restarts continue it by themselves)"
        )
