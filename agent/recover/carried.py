"""The watchdog's state a framework's own checkpoint carries, so a restart from it keeps it.

    state = carried_state(watchdog, step=120, tick=131)       # at the framework's save
    tensor = state.to_tensor()                                 # one uint8 tensor, fixed size
    state = CarriedState.from_tensor(tensor)                   # at its load: checked, or refused
    adopt(watchdog, state, tick=0, source="torchtitan checkpoint step-120")

A framework that saves its own checkpoints (torchtitan's ``CheckpointManager``) knows nothing of
the learning-rate back-off, the skipped batches or the rollbacks the loop guard counts; without
them a restart from its checkpoint would train at the full learning rate again. This is that
state, as one JSON document in a fixed-size ``uint8`` tensor: DCP saves and loads it like any
tensor (read with ``weights_only=True``, nothing pickled), and the fixed size lets a load
template of a fresh process match any saved one. Every value is checked the way the ledger's
are (a scale in (0, 1], ranges a rollback could have made) before it is acted on.

``adopt`` never loosens what the watchdog already holds: the scale becomes the smaller of the
two, the skip list their union (the new ranges recorded in the ledger, so its own check holds
on the next load), and the loop guard counts the earlier process's recent rollbacks too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch

from ...errors import TorchvitalsError

CAPACITY = 1 << 16
"""Bytes of the tensor: thousands of skipped ranges, and a few hundred rollbacks in the window."""
VERSION = 1


class CarriedStateError(TorchvitalsError, ValueError):
    """A carried-state tensor that torchvitals did not write, or would not act on."""


@dataclass(frozen=True, kw_only=True)
class CarriedState:
    """What a restart from a framework's checkpoint needs of the watchdog."""

    step: int
    """The model step the checkpoint holds (the agent's step count at the save)."""
    lr_scale: float = 1.0
    """The cumulative back-off of the rollbacks so far, in (0, 1]."""
    skipped: list[tuple[int, int]] = field(default_factory=list)
    """The batch ranges ``[start, stop)`` never to be trained on."""
    position: int = 0
    """The global index of the next batch ``agent.batches`` draws (0: the loop's own loader)."""
    rollbacks_ago: list[int] = field(default_factory=list)
    """Ticks before the save of each rollback the loop guard still counted, oldest first."""

    def to_tensor(self) -> torch.Tensor:
        """The state as a ``uint8`` tensor of ``CAPACITY`` bytes (JSON, zero-padded).

        Raises:
            CarriedStateError: the document does not fit.
        """
        raw = json.dumps(
            {
                "version": VERSION,
                "step": self.step,
                "lr_scale": self.lr_scale,
                "skipped": [list(r) for r in self.skipped],
                "position": self.position,
                "rollbacks_ago": list(self.rollbacks_ago),
            },
            separators=(",", ":"),
        ).encode()
        if len(raw) > CAPACITY:
            raise CarriedStateError(
                f"the watchdog's state is {len(raw)} bytes, over the "
                f"{CAPACITY} a framework checkpoint carries"
            )
        out = torch.zeros(CAPACITY, dtype=torch.uint8)
        out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return out

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> CarriedState:
        """The state ``to_tensor`` wrote, checked.

        Raises:
            CarriedStateError: not such a tensor, or a value no run could have written.
        """
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise CarriedStateError(
                f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, not torchvitals' state"
            )
        raw = bytes(tensor.cpu().numpy().tobytes()).rstrip(b"\0")
        try:
            doc = json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise CarriedStateError(f"not a JSON document ({e})") from None
        return cls._checked(doc)

    @classmethod
    def _checked(cls, doc: Any) -> CarriedState:
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise CarriedStateError(f"not a version-{VERSION} torchvitals state")

        def count(value: object) -> TypeGuard[int]:
            return type(value) is int and value >= 0

        def number(value: object) -> TypeGuard[float]:
            return type(value) in (int, float)  # not a bool

        step, scale, position = doc.get("step"), doc.get("lr_scale"), doc.get("position")
        skipped, ago = doc.get("skipped"), doc.get("rollbacks_ago")
        if not (count(step) and count(position)):
            raise CarriedStateError(f"step {step!r} and position {position!r} must be counts")
        if not (number(scale) and math.isfinite(scale) and 0 < scale <= 1):
            raise CarriedStateError(
                f"lr_scale {scale!r} is not in (0, 1]: each rollback "
                "multiplies it by lr_backoff <= 1, from 1"
            )
        if not (
            isinstance(skipped, list)
            and all(
                isinstance(r, list) and len(r) == 2 and all(count(x) for x in r) and r[0] < r[1]
                for r in skipped
            )
        ):
            raise CarriedStateError(f"skipped {skipped!r} is not a list of [start, stop) ranges")
        if not (isinstance(ago, list) and all(count(a) for a in ago)):
            raise CarriedStateError(f"rollbacks_ago {ago!r} is not a list of tick counts")
        return cls(
            step=step,
            lr_scale=float(scale),
            skipped=[(a, b) for a, b in skipped],
            position=position,
            rollbacks_ago=ago,
        )


def carried_state(watchdog: Any, *, step: int, tick: int) -> CarriedState:
    """What ``watchdog`` (or None: no watchdog, nothing backed off) holds at ``step``.

    Args:
        watchdog: the agent's Watchdog, or None.
        step: the model step being saved.
        tick: the agent's tick counter now (rolled-back steps included).
    """
    if watchdog is None:
        return CarriedState(step=step)
    return CarriedState(
        step=step,
        lr_scale=watchdog.lr_scale,
        skipped=list(watchdog.ledger.skipped),
        position=watchdog.data.position,
        rollbacks_ago=watchdog.rollback_policy.history(tick),
    )


def adopt(watchdog: Any, state: CarriedState, *, tick: int, source: str) -> None:
    """Take ``state`` into ``watchdog`` at a restart from the checkpoint that carried it.

    Args:
        watchdog: the agent's Watchdog (ledger loaded, possibly resumed from an older step).
        state: the checkpoint's state.
        tick: the agent's tick counter now.
        source: the checkpoint, for the ledger and the log line.
    """
    ledger, policy = watchdog.ledger, watchdog.rollback_policy
    known = set(ledger.skipped)
    new = [r for r in state.skipped if r not in known]
    scale = min(policy.lr_scale, state.lr_scale)
    if new or scale != ledger.lr_scale:
        ledger.record_adopted(state.step, source=source, lr_scale=scale, skipped=new)
    policy.lr_scale = scale
    policy.remember(state.rollbacks_ago, tick)
    watchdog.data.resume_at = max(watchdog.data.resume_at, state.position)
    watchdog.say(
        "torchvitals: resumed from %s: step %d, learning-rate scale %g, %d batches "
        "skipped, %d recent rollbacks counted (ledger %s)",
        source,
        state.step,
        scale,
        ledger.skipped.batches(),
        len(state.rollbacks_ago),
        ledger.path,
    )
