"""The optimizers torch itself runs: one ``torch.optim.Optimizer``, or a container of them.

    TorchBackend(resolve(optimizer))        # AdamW, SGD, ... (DDP, FSDP2, one process)
    ContainerBackend(resolve(container))    # torchtitan's OptimizersContainer shape

Both keep the gradients in ``param.grad`` (a DTensor's local shard under FSDP2) and the state
keyed by parameter, so DCP's state dicts checkpoint them (``recover/state.py``) and the measures
read the parameters themselves. A container's own ``step`` is what the loop calls and the guard
takes; the optimizers inside it hold the learning rates and the state (``optimizers.resolve``),
and a checkpoint flattens their state into one dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .base import GradSource, HasParamGroups, ParamSource
from .optimizers import Optimizers


@dataclass(frozen=True)
class TorchBackend:
    """One torch optimizer (``OptimizerBackend``): it steps, holds its LRs and its state."""

    kind: ClassVar[str] = "torch"
    optimizers: Optimizers

    @property
    def stepper(self) -> Any:
        return self.optimizers.stepped

    @property
    def state_holder(self) -> Any:
        return self.optimizers.stepped

    @property
    def grad_source(self) -> GradSource | None:
        return None  # param.grad

    @property
    def param_source(self) -> ParamSource | None:
        return None  # the parameter

    @property
    def stepped_params(self) -> HasParamGroups:
        return self.optimizers

    def check_checkpointable(self, checkpoint_dir: str | None) -> None:
        return None  # DCP's state dicts cover every torch optimizer


@dataclass(frozen=True)
class ContainerBackend(TorchBackend):
    """A container of torch optimizers (``OptimizerBackend``): its ``step`` is guarded, the
    optimizers inside it hold the LRs and the state, checkpointed as one flattened dict."""

    kind: ClassVar[str] = "container"
