"""What ``watch()`` guards when it is handed a framework's wrapper instead of a torch optimizer.

    optimizer, note = unwrap_optimizer(accelerated_optimizer)   # the torch optimizer inside
    scheduler = unwrap_scheduler(accelerated_scheduler).logged(log)   # what the agent checkpoints

``accelerator.prepare`` returns an ``AcceleratedOptimizer`` and an ``AcceleratedScheduler``;
DeepSpeed's engine holds a ZeRO optimizer. None of them is a working ``torch.optim.Optimizer``,
but each holds one as ``.optimizer``. Accelerate's forwards its step to it only when a real step
is due (``accumulate``), so the guard goes on that inner optimizer; which object's step the
guard takes for a ZeRO optimizer, and where its gradients are read, is its backend's
(``choose.py``). Anything that is neither an optimizer nor a wrapper of one is refused at
``watch()`` with what it accepts.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from ...errors import TorchvitalsError
from .optimizers import is_container

MAX_DEPTH = 4
"""Wrappers peeled at most (accelerate around DeepSpeed around torch is three)."""


class Unwrapped(NamedTuple):
    """What the agent uses, and a line for the user when it is not what they passed."""

    obj: Any
    """The torch optimizer to guard, or the scheduler to checkpoint and step."""
    note: str | None
    """Names the wrapper(s) peeled; None when the object was used as passed."""

    def logged(self, log: logging.Logger) -> Any:
        """``obj``, the note logged (at info) when there is one."""
        if self.note is not None:
            log.info(self.note)
        return self.obj


def _name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def unwrap_optimizer(obj: Any) -> Unwrapped:
    """The ``torch.optim.Optimizer`` that ``obj`` is, or that its ``.optimizer`` chain holds.

    Args:
        obj: a torch optimizer, or a wrapper exposing one as ``.optimizer`` (accelerate's
            ``AcceleratedOptimizer``, DeepSpeed's ZeRO optimizer, accelerate around DeepSpeed).

    Returns:
        The torch optimizer and a note naming the wrappers peeled (None if ``obj`` was one).

    Raises:
        TorchvitalsError: ``obj`` is neither, named with what ``watch()`` accepts.
    """
    chain: list[Any] = []
    inner = obj
    # Peeled whenever it holds one: accelerate's wrapper subclasses torch.optim.Optimizer
    # without being initialised as one (no hooks, no state of its own). A container of
    # optimizers (torchtitan's shape) is kept whole: ``optimizers.resolve`` opens it.
    while not (is_torch_optimizer(inner) or is_container(inner)):
        nested = getattr(inner, "optimizer", None)
        if nested is None or nested is inner or len(chain) >= MAX_DEPTH:
            raise TorchvitalsError(
                f"torchvitals.watch() needs a torch.optim.Optimizer, a wrapper that holds one "
                f"as .optimizer (accelerate's AcceleratedOptimizer, DeepSpeed's ZeRO optimizer), "
                f"or a container of them (torchtitan's OptimizersContainer; for its Trainer use "
                f"torchvitals.watch_torchtitan(trainer)); got {_name(obj)}"
                + (
                    f" (through {' -> '.join(_name(c) for c in [*chain[1:], inner])})"
                    if chain
                    else ""
                )
                + ", which holds no torch optimizer. Pass the optimizer that steps the model."
            )
        chain.append(inner)
        inner = nested
    if not chain:
        return Unwrapped(inner, None)
    return Unwrapped(
        inner,
        "torchvitals: guarding the torch optimizer "
        f"{_name(inner)} inside {' -> '.join(_name(c) for c in chain)}: "
        "stepping the wrapper steps it through torchvitals",
    )


def unwrap_scheduler(obj: Any) -> Unwrapped:
    """The LR scheduler the agent checkpoints, restores and (from ``agent.step``) steps.

    A wrapper is kept as passed when it forwards ``state_dict``/``load_state_dict`` (accelerate's
    ``AcceleratedScheduler`` does, and its ``step`` applies accelerate's own rules: steps only
    when the gradients were synchronised, once per process). A wrapper without them is peeled
    through its ``.scheduler``.

    Args:
        obj: None, a scheduler, or a wrapper holding one as ``.scheduler``.

    Returns:
        The scheduler (None stays None) and a note when one was peeled.

    Raises:
        TorchvitalsError: ``obj`` has no ``step``/``state_dict``/``load_state_dict`` and wraps
            nothing that has them.
    """
    chain: list[Any] = []
    inner = obj
    while inner is not None and not _schedules(inner):
        nested = getattr(inner, "scheduler", None)
        if nested is None or nested is inner or len(chain) >= MAX_DEPTH:
            raise TorchvitalsError(
                f"torchvitals.watch()'s scheduler must have step(), state_dict() and "
                f"load_state_dict() (a torch LR scheduler, accelerate's AcceleratedScheduler), "
                f"or hold one as .scheduler; got {_name(obj)}"
            )
        chain.append(inner)
        inner = nested
    if not chain:
        return Unwrapped(inner, None)
    return Unwrapped(
        inner,
        f"torchvitals: checkpointing the scheduler {_name(inner)} inside "
        f"{' -> '.join(_name(c) for c in chain)}",
    )


def is_torch_optimizer(obj: Any) -> bool:
    """A torch optimizer initialised as one (its own step hooks), not a subclass wrapping one."""
    return (
        isinstance(obj, torch.optim.Optimizer)
        and "_optimizer_step_pre_hooks" in vars(obj)
        and not isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)
    )


def _schedules(obj: Any) -> bool:
    return all(callable(getattr(obj, n, None)) for n in ("step", "state_dict", "load_state_dict"))
