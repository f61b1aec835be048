"""The signals every agent packs, in the order every rank packs them, built once at ``watch()``.

    built = build_signals(BUILTIN, setup, user_signals)   # agent.py, at watch()
    built.all            # the step's signals: the built-in ones in registry order, then the user's

A built-in signal registers like a user's would: one module with a ``Signal`` subclass and its
``build(setup)`` factory, named once in ``BUILTIN`` below. The order is part of the contract:
the scaler reads the loss's and the gradients' non-finite flags, the timing the data wait.
Nothing here runs per step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from ...errors import TorchvitalsError
from . import (
    activations,
    checkpoint,
    datawait,
    directive_code,
    grads,
    loss,
    memory,
    replicas,
    scaler,
    timing,
    update,
)
from .activations import ActivationSignal
from .base import Signal
from .grads import GradNorms
from .setup import Setup
from .update import UpdateRatioSignal

Factory = Callable[[Setup], "Signal | None"]
"""Builds one signal for this run, or None when it is off (a setting, no watchdog, no DDP)."""
S = TypeVar("S", bound=Signal)


class SignalRegistry:
    """Named signal factories in packing order.

    Args:
        entries: ``(name, factory)`` pairs, in the order the signals pack.
    """

    def __init__(self, entries: Iterable[tuple[str, Factory]] = ()) -> None:
        self._entries: dict[str, Factory] = {}
        for name, factory in entries:
            self.register(name, factory)

    def register(self, name: str, factory: Factory) -> None:
        """Add ``factory`` last, under a name no other entry has."""
        if name in self._entries:
            raise ValueError(f"a signal named {name!r} is already registered")
        self._entries[name] = factory

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __iter__(self) -> Iterator[tuple[str, Factory]]:
        return iter(self._entries.items())

    def build(self, setup: Setup) -> list[Signal]:
        """Every registered signal that is on for this run, in order."""
        return [s for _, factory in self for s in [factory(setup)] if s is not None]


BUILTIN = SignalRegistry(
    [
        ("loss", loss.build),
        ("grads", grads.build),
        ("scaler", scaler.build),
        ("update", update.build),
        ("activations", activations.build),
        ("data_wait", datawait.build),
        ("timing", timing.build),
        ("memory", memory.build),
        ("replicas", replicas.build),
        ("checkpoint", checkpoint.build),
        ("directive", directive_code.build),
    ]
)
"""The built-in vital signs."""


@dataclasses.dataclass(frozen=True)
class Signals:
    """What the agent packs, with the three signals the step and the agent call by name."""

    all: tuple[Signal, ...]
    """Every signal, in packing order."""
    grads: GradNorms
    update: UpdateRatioSignal | None
    """Snapshotted around the real step before a sampled one (None: ``update_ratio`` off)."""
    activations: ActivationSignal | None
    """Armed before a sampled step (None: ``activations`` off)."""


def build_signals(registry: SignalRegistry, setup: Setup, extra: Sequence[Signal]) -> Signals:
    """The registry's signals for this run, then ``extra`` (the user's), checked.

    Raises:
        TypeError: an entry of ``extra`` is not a ``torchvitals.Signal``.
        TorchvitalsError: on every rank, when the ranks were given different user signals.
    """
    for signal in extra:
        if not isinstance(signal, Signal):
            raise TypeError(
                f"watch(signals=...) takes torchvitals.Signal instances, not "
                f"{type(signal).__name__}"
            )
    built = registry.build(setup)
    agree_on(extra, setup)  # on every rank of a world, so a rank given none still takes part
    return Signals(
        tuple(built) + tuple(extra),
        _one(built, GradNorms),
        _first(built, UpdateRatioSignal),
        _first(built, ActivationSignal),
    )


def agree_on(signals: Sequence[Signal], setup: Setup) -> None:
    """Check that every rank packs the same user signals (collective, once, at ``watch()``, on
    every rank of a world: a rank given none takes part too).

    A mismatch would break the step's collective (gloo aborts the process, NCCL may hang), so
    it is caught here: each rank's digest of the signals' classes, in order, and its negation
    ride one MAX; the ranks agree only when the maximum equals minus the maximum of the
    negation, which every rank reads alike, so every rank raises together.
    """
    if setup.world_size == 1:
        return
    names = ";".join(f"{type(s).__module__}.{type(s).__qualname__}" for s in signals)
    digest = float(int.from_bytes(hashlib.sha256(names.encode()).digest()[:3], "big"))
    count = float(len(signals))
    seen = torch.tensor([digest, -digest, count, -count], dtype=torch.float64)
    seen = seen.to(setup.collective_device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=setup.group)
    high_digest, neg_low_digest, high_count, neg_low_count = seen.tolist()
    if high_digest != -neg_low_digest or high_count != -neg_low_count:
        raise TorchvitalsError(
            f"torchvitals: the ranks were given different signals (this rank: {names or 'none'}"
            "): every rank must pass the same watch(signals=[...]), in the same order"
        )


def _first(signals: Iterable[Signal], cls: type[S]) -> S | None:
    return next((s for s in signals if isinstance(s, cls)), None)


def _one(signals: Iterable[Signal], cls: type[S]) -> S:
    found = _first(signals, cls)
    if found is None:
        raise TorchvitalsError(f"torchvitals: no {cls.__name__} signal was built")
    return found
