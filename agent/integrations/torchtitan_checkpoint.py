"""torchtitan's own checkpoints kept consistent with torchvitals' rollbacks and back-off.

    checkpoints = TitanCheckpoints(trainer, agent, set_step)   # watch_torchtitan does this
    trainer.train()        # its checkpointer.load() and save(step) now carry torchvitals' state

When torchtitan's ``CheckpointManager`` is enabled, the key ``"torchvitals"`` of its ``states``
holds the watchdog's state (``recover/carried.py``: the learning-rate back-off, the skipped
batches, the rollbacks the loop guard still counts, the step), one ``uint8`` tensor that DCP
saves with the model, the optimizers, the schedulers, the data loader and the train state. So
each checkpoint torchtitan writes after a rollback holds the restored weights, the step and the
scheduler the rollback set, and the back-off; a restart from it (``--checkpoint.enable`` on the
same folder, the usual torchtitan restart) trains on at that back-off.

Which checkpoint a restart takes when both folders hold one: the newer step. torchvitals'
``checkpoint_dir`` is read first, at ``watch_torchtitan`` (as ``Config.resume`` allows); then
``trainer.train()`` calls torchtitan's ``load``, which this class wraps: when torchvitals
resumed from a step newer than torchtitan's latest (or torchtitan's folder holds none),
torchtitan's load is left off; otherwise torchtitan's checkpoint is loaded (on a tie too: it
also holds torchtitan's data loader position, which torchvitals' checkpoint does not) and its
carried state is adopted: the smaller learning-rate scale of the two, the union of the skip
lists (recorded in the ledger), the agent's step count set to torchtitan's. A torchtitan
checkpoint written without torchvitals is loaded without that key, with a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from ..agent import Agent
from ..compat.torchtitan import titan_checkpoint_to_load
from ..patches import AttributePatch
from ..recover.carried import CarriedState, adopt, carried_state
from ..recover.trust import SafeReader, UntrustedCheckpoint

log = logging.getLogger(__name__)

STATE_KEY = "torchvitals"
"""The key of ``CheckpointManager.states`` (and the DCP prefix) torchvitals' state lives under."""
DOCUMENT = "document"


class TitanCheckpoints(Stateful):
    """The ``"torchvitals"`` entry of torchtitan's checkpoints and the wrap of its ``load``.

    Args:
        trainer: torchtitan's built ``Trainer`` whose ``checkpointer`` is enabled.
        agent: the agent watching it.
        set_step: sets the agent's model step (``Agent.resume_at``, with the load's seconds) and
            the trainer's after a load.
    """

    def __init__(self, trainer: Any, agent: Agent, set_step: Callable[[int, float], None]) -> None:
        self.trainer, self.agent, self._set_step = trainer, agent, set_step
        self.checkpointer = trainer.checkpointer
        self.adopted: CarriedState | None = None
        """The state taken from torchtitan's checkpoint at the start (None: none was)."""
        self._loaded: CarriedState | None = None
        self.checkpointer.states[STATE_KEY] = self
        self._patch = AttributePatch(self.checkpointer, "load", lambda _: self.load)
        self._patch.install()
        self._load = self._patch.wrapped

    # ------------------------------------------------------------------ DCP's Stateful

    def state_dict(self) -> dict[str, Any]:
        """The watchdog's state now (a save), or the template a load fills (same shape)."""
        agent = self.agent
        state = carried_state(agent.watchdog, step=agent.step_count, tick=agent.ticks)
        return {DOCUMENT: state.to_tensor()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the loaded state (checked); ``load`` adopts it once torchtitan's load is done."""
        self._loaded = CarriedState.from_tensor(state_dict[DOCUMENT])

    # ------------------------------------------------------------------ the load

    def load(self, step: int = -1) -> bool:
        """torchtitan's ``checkpointer.load(step)``, or not, by the newer-step rule (module).

        Returns:
            Whether a checkpoint was loaded (torchtitan's, or torchvitals' at ``watch``).
        """
        target, folder = titan_checkpoint_to_load(self.checkpointer, step)
        ours = self.agent.resumed_from
        if ours is not None and ours > target:
            if self.agent.watchdog is not None:
                self.agent.watchdog.say(
                    "torchvitals: resumed from its own checkpoint of step %d; torchtitan's "
                    "checkpoint load is left off (its folder's latest: %s)",
                    ours,
                    f"step {target}" if target >= 0 else "none",
                )
            return True
        carries = target > 0 and folder is not None and _holds_state(folder)
        states = self.checkpointer.states
        excluded = STATE_KEY in getattr(self.checkpointer, "exclude_from_loading", ())
        if not carries and not excluded:
            del states[STATE_KEY]  # DCP would refuse a key the checkpoint lacks
        began = time.monotonic()
        try:
            loaded = self._load(step)
        finally:
            states[STATE_KEY] = self
        state, self._loaded = self._loaded, None
        if not loaded or target <= 0:
            return loaded
        titan_step = int(self.trainer.step)
        # the agent's resume_at: its step count and resumed_from, and the load as checkpoint time
        self._set_step(titan_step, time.monotonic() - began)
        source = f"torchtitan checkpoint {folder}"
        if state is None:
            log.warning(
                "torchvitals: %s holds no torchvitals state (written without it, or "
                "%r excluded from loading): no back-off or skip list carried over",
                source,
                STATE_KEY,
            )
        elif state.step != titan_step:
            log.warning(
                "torchvitals: %s carries torchvitals' state of step %d, not of its "
                "train state's step %d: not adopted",
                source,
                state.step,
                titan_step,
            )
        elif self.agent.watchdog is not None:
            adopt(self.agent.watchdog, state, tick=self.agent.ticks, source=source)
            self.adopted = state
        elif state.lr_scale < 1 or state.skipped:
            log.warning(
                "torchvitals: %s carries a learning-rate scale of %g and %d skipped "
                "ranges, not applied: without checkpoint_dir torchvitals does not roll "
                "back or back off",
                source,
                state.lr_scale,
                len(state.skipped),
            )
        return loaded

    def close(self) -> None:
        """torchtitan's own ``load`` back, and the ``"torchvitals"`` entry out of its states."""
        self._patch.uninstall()
        if self.checkpointer.states.get(STATE_KEY) is self:
            del self.checkpointer.states[STATE_KEY]


def _holds_state(folder: str) -> bool:
    """Whether the DCP checkpoint in ``folder`` has torchvitals' state (its metadata read with
    torchvitals' restricted unpickler)."""
    try:
        metadata = SafeReader(folder).read_metadata()
    except (UntrustedCheckpoint, OSError) as error:
        log.warning(
            "torchvitals: cannot read %s's DCP metadata (%s): loading it without "
            "torchvitals' state",
            folder,
            error,
        )
        return False
    return f"{STATE_KEY}.{DOCUMENT}" in metadata.state_dict_metadata
