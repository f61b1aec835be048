"""What the agent asks of an optimizer, whatever its kind: ``OptimizerBackend``.

    backend = choose(optimizer)                 # once, at watch(): see choose.py
    StepGuard(..., stepper=backend.stepper)     # whose step() the guard takes
    GradStats(..., backend.grad_source)         # where the gradients are read

A torch optimizer keeps its gradients in ``param.grad`` and its state keyed by parameter; a
partitioned optimizer (DeepSpeed's ZeRO) keeps this rank's share of both in buffers of its own.
Each kind is one backend, chosen once, and the agent, the measures and the checkpoints ask it
instead of testing the kind again: the backend is the only place that knows where a kind keeps
its gradients, its partitions and its state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch

from .optimizers import Optimizers

GradSource = Callable[[torch.Tensor], torch.Tensor | None]
"""``source(param)``: this rank's part of ``param``'s gradient, or None when it holds none now."""
ParamSource = Callable[[torch.Tensor], torch.Tensor]
"""``source(param)``: this rank's values of ``param`` (a view; possibly empty)."""


class ParamGroups(NamedTuple):
    """Stands for an optimizer where only its model parameters are read (the wiring check)."""

    param_groups: list[dict[str, Any]]


class HasParamGroups(Protocol):
    """Anything with an optimizer's ``param_groups`` (a torch optimizer, ``Optimizers``)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


@runtime_checkable
class PartitionedState(Protocol):
    """A state holder whose state no parameter name maps to (this rank's partitions): it says
    itself what a checkpoint saves and how a restore loads it back in place
    (``recover/state.py`` asks it instead of DCP's state dicts)."""

    def states(self, model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizer's state, holding the live tensors (no copy)."""
        ...

    def load_states(
        self, model: torch.nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]
    ) -> None:
        """Load what ``states`` returned (or a saved copy of it) in place."""
        ...


class OptimizerBackend(Protocol):
    """One kind of optimizer, as the agent sees it: chosen once at ``watch()``."""

    kind: ClassVar[str]
    """``"torch"``, ``"container"``, ``"zero"`` (DeepSpeed ZeRO-1/2) or ``"zero3"``."""

    @property
    def optimizers(self) -> Optimizers:
        """The torch optimizers that hold the learning rates (and, unpartitioned, the state)."""
        ...

    @property
    def stepper(self) -> Any:
        """The object whose ``step`` the guard replaces (one agent step per call)."""
        ...

    @property
    def state_holder(self) -> Any:
        """What checkpoints and rollbacks save the optimizer state of and restore it into: a
        torch optimizer or container (DCP's state dicts), or a ``PartitionedState``."""
        ...

    @property
    def grad_source(self) -> GradSource | None:
        """Where the gradients are read when they are not in ``param.grad`` (None: they are)."""
        ...

    @property
    def param_source(self) -> ParamSource | None:
        """Where this rank's values of a parameter are read when the parameter is not whole on
        every rank (None: the parameter itself)."""
        ...

    @property
    def stepped_params(self) -> HasParamGroups:
        """What holds the model parameters a step updates, as ``param_groups``."""
        ...

    def check_checkpointable(self, checkpoint_dir: str | None) -> None:
        """Refuse, at ``watch()``, a watchdog this optimizer's state cannot go through.

        Raises:
            TorchvitalsError: ``checkpoint_dir`` is set and the state cannot be checkpointed.
        """
        ...
