"""torchtitan's private names torchvitals calls: where its ``CheckpointManager`` would load from.

    step, folder = titan_checkpoint_to_load(trainer.checkpointer)    # (-1, None): none there

torchvitals resumes beside torchtitan's own checkpoints, so it asks torchtitan 0.3.0's
``CheckpointManager`` which ``step-N`` folder its ``load()`` would read, through two private
methods. ``problems()`` checks them when torchtitan is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .versions import CompatError

TITAN_FIND_LOAD_STEP = "_find_load_step"
TITAN_CHECKPOINT_ID = "_create_checkpoint_id"
"""torchtitan 0.3.0's ``CheckpointManager``: the newest ``step-N`` of its folder that holds a
checkpoint (-1: none), and the folder of step N (read only by ``titan_checkpoint_to_load``)."""
TITAN_CHECKPOINT_MODULE = "torchtitan.components.checkpoint"
"""Where torchtitan's ``CheckpointManager`` lives."""


def titan_checkpoint_to_load(checkpointer: Any, step: int = -1) -> tuple[int, str | None]:
    """``(step, folder)`` that torchtitan's ``checkpointer.load(step)`` would read from its own
    folder; ``(-1, None)`` when that folder holds none (torchtitan then starts afresh, or from
    its ``initial_load_path``).

    Raises:
        CompatError: the checkpointer lacks either private method (another torchtitan).
    """
    for name in (TITAN_FIND_LOAD_STEP, TITAN_CHECKPOINT_ID):
        if not callable(getattr(checkpointer, name, None)):
            raise CompatError(
                f"torchvitals needs torchtitan's CheckpointManager.{name} "
                "(torchtitan 0.3.0): it is gone"
            )
    target = getattr(checkpointer, TITAN_FIND_LOAD_STEP)() if step == -1 else step
    if target < 0:
        return -1, None
    return target, str(getattr(checkpointer, TITAN_CHECKPOINT_ID)(target))


def problems() -> list[str]:
    """The methods above that the installed torchtitan lacks; empty without torchtitan."""
    if importlib.util.find_spec("torchtitan") is None:
        return []
    # Imported here, not at the top: torchtitan is optional, and slow to import.
    try:
        checkpoint = importlib.import_module(TITAN_CHECKPOINT_MODULE)
    except ImportError as exc:  # installed without what its checkpointing imports
        return [f"{TITAN_CHECKPOINT_MODULE} does not import: {exc}"]
    manager = getattr(checkpoint, "CheckpointManager", None)
    if manager is None:
        return [f"{TITAN_CHECKPOINT_MODULE}.CheckpointManager is gone"]
    return [
        f"{TITAN_CHECKPOINT_MODULE}.CheckpointManager.{name} is gone"
        for name in (TITAN_FIND_LOAD_STEP, TITAN_CHECKPOINT_ID)
        if not callable(getattr(manager, name, None))
    ]
