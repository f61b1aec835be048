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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from ...errors import TorchvitalsError
from . import (
    activations,
    checkpoint,
    datawait,
    directive_code,
    grads,
    loop,
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
        ("loop", loop.build),
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

    That every rank packs the same signals, in the same order, is agreed with the rest at the
    end of ``watch()`` (``consensus.Fence``: the signals' names ride its digest).

    Raises:
        TypeError: an entry of ``extra`` is not a ``torchvitals.Signal``.
    """
    for signal in extra:
        if not isinstance(signal, Signal):
            raise TypeError(
                f"watch(signals=...) takes torchvitals.Signal instances, not "
                f"{type(signal).__name__}"
            )
    built = registry.build(setup)
    return Signals(
        tuple(built) + tuple(extra),
        _one(built, GradNorms),
        _first(built, UpdateRatioSignal),
        _first(built, ActivationSignal),
    )


def _first(signals: Iterable[Signal], cls: type[S]) -> S | None:
    return next((s for s in signals if isinstance(s, cls)), None)


def _one(signals: Iterable[Signal], cls: type[S]) -> S:
    found = _first(signals, cls)
    if found is None:
        raise TorchvitalsError(f"torchvitals: no {cls.__name__} signal was built")
    return found
