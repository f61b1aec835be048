"""What the real optimizers behind the object passed to ``watch()`` are.

    optimizers = resolve(optimizer)     # raises a TorchvitalsError naming what to pass
    optimizers.stepped.step()            # the object the training loop steps (the guard's)
    optimizers.param_groups              # every inner optimizer's groups, each with its "lr"
    optimizers.torch_optimizers          # what the state dicts are read from and written to

A training loop steps one object, but the learning rates and the state may live in several
optimizers inside it: torchtitan's ``OptimizersContainer`` is a ``torch.optim.Optimizer`` whose
own single param group (no ``lr``) holds every parameter, while one AdamW per model part (and
per optimizer kind) holds the real groups and state. This module is the one place that tells
them apart; ``choose.py`` picks the backend of either from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import TorchvitalsError


@dataclass(frozen=True)
class Optimizers:
    """The optimizer object the loop steps and the torch optimizers that do the work."""

    stepped: torch.optim.Optimizer
    """The object whose ``step()`` the training loop calls (one agent step per call)."""
    torch_optimizers: tuple[torch.optim.Optimizer, ...]
    """The optimizers holding the learning rates and the state, in a fixed order."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every inner optimizer's param groups, in order (the ones with an ``lr``)."""
        return [g for opt in self.torch_optimizers for g in opt.param_groups]

    @property
    def is_container(self) -> bool:
        """Whether the stepped object only delegates to the optimizers inside it."""
        return self.torch_optimizers != (self.stepped,)

    def state_target(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        """What ``torch.distributed.checkpoint.state_dict`` takes for these optimizers."""
        return self.torch_optimizers[0] if not self.is_container else list(self.torch_optimizers)


def resolve(optimizer: Any) -> Optimizers:
    """The optimizers behind ``optimizer``.

    Args:
        optimizer: a ``torch.optim.Optimizer``, or a container of them shaped like torchtitan's
            ``OptimizersContainer`` (an optimizer whose ``optimizers`` list, or whose iteration,
            yields the real optimizers and whose own param groups carry no ``lr``).

    Returns:
        The Optimizers.

    Raises:
        TorchvitalsError: ``optimizer`` is neither, naming what to pass instead.
    """
    if isinstance(optimizer, Optimizers):
        return optimizer
    inner = _inner(optimizer)
    if inner:
        if not isinstance(optimizer, torch.optim.Optimizer) and not callable(
            getattr(optimizer, "step", None)
        ):
            raise _not_an_optimizer(optimizer)
        for opt in inner:
            _check_groups(opt)
        return Optimizers(optimizer, tuple(inner))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise _not_an_optimizer(optimizer)
    _check_groups(optimizer)
    return Optimizers(optimizer, (optimizer,))


def is_container(optimizer: Any) -> bool:
    """Whether ``optimizer`` holds the real optimizers (torchtitan's container shape)."""
    return bool(_inner(optimizer))


def _inner(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The optimizers a container holds ([] for a plain optimizer or anything else)."""
    if isinstance(optimizer, torch.optim.Optimizer) and all(
        "lr" in g for g in optimizer.param_groups
    ):
        return []  # a real optimizer, even one that happens to be iterable
    held = getattr(optimizer, "optimizers", None)
    if held is None and hasattr(optimizer, "__iter__") and not isinstance(optimizer, (str, bytes)):
        try:
            held = list(optimizer)
        except TypeError:
            held = None
    if not isinstance(held, (list, tuple)) or not held:
        return []
    if not all(isinstance(o, torch.optim.Optimizer) for o in held):
        return []
    return list(held)


def _check_groups(optimizer: torch.optim.Optimizer) -> None:
    missing = [i for i, g in enumerate(optimizer.param_groups) if "lr" not in g]
    if missing:
        raise TorchvitalsError(
            f"torchvitals: {type(optimizer).__name__}'s param groups {missing} have no 'lr', and "
            f"it holds no optimizers that do: pass the torch.optim.Optimizer that trains the "
            f"model (or a container whose .optimizers lists them, like torchtitan's "
            f"OptimizersContainer)"
        )


def _not_an_optimizer(optimizer: Any) -> TorchvitalsError:
    return TorchvitalsError(
        f"torchvitals.watch() needs the optimizer, got {type(optimizer).__name__}: pass a "
        f"torch.optim.Optimizer, or a container of them whose .optimizers (or iteration) yields "
        f"torch.optim.Optimizer objects, like torchtitan's OptimizersContainer; for torchtitan's "
        f"Trainer use torchvitals.watch_torchtitan(trainer)"
    )
