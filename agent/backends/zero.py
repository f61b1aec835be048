"""DeepSpeed's ZeRO-1/2 optimizer: its backend, and its partitioned state as checkpoints see it.

    backend = ZeroBackend(resolve(engine.optimizer.optimizer), engine.optimizer)
    model_sd, optim_sd = backend.state_holder.states(engine)   # the live tensors (no copy)
    backend.state_holder.load_states(engine, model_sd, optim_sd)   # loaded back in place

Its ``step`` checks for overflow, clips the partitioned gradients and steps its torch optimizer
once per param group, so the guard takes the ZeRO optimizer's own ``step`` (the gradients are
measured before it clips, one agent step however many groups), and the gradients are read from
its partitions: each rank holds a disjoint fragment of each gradient (``grad_source``).

Under ZeRO-1/2 every rank holds the whole model (its parameters are views into DeepSpeed's flat
buffers) but only its own partition of the optimizer: the fp32 master copy of its slice of each
param group's flat buffer, and the torch optimizer's state (Adam's moments, its step) over that
slice. DCP's optimizer state dict cannot map those flat slices to parameter names, so they are
saved under a key of this rank's partition::

    {"zero-rank-00001-of-00002": {"group-0": {"master": <flat fp32 slice>,
                                              "state": {"exp_avg": ..., "step": ...},
                                              "hparams": {"lr": ..., "betas": ...}}, ...}}

Each rank writes and reads only its own key (DCP writes a key held by one rank once, by that
rank), so the checkpoint loads into the same number of partitions only: another world size
finds no key for its partitions and the folder is refused with DCP's "missing key" naming it.
The model's state goes through DCP's model state dict as for any other model. A restore
copies in place, so DeepSpeed's own references (its flat buffers, its torch optimizer's param
groups, the views the model's parameters are) stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from ..compat.deepspeed import (
    zero_grad_fragment,
    zero_model_params,
    zero_partition_rank,
    zero_partitions,
)
from ..compat.pytorch import init_optim_state
from .base import GradSource, HasParamGroups, ParamGroups, ParamSource
from .optimizers import Optimizers


@dataclass(frozen=True)
class ZeroBackend:
    """DeepSpeed's ZeRO-1/2 optimizer (``OptimizerBackend``).

    Args:
        optimizers: its torch optimizer (flat fp32 partitions, the learning rates).
        owner: the ZeRO optimizer (``engine.optimizer``).
    """

    kind: ClassVar[str] = "zero"
    optimizers: Optimizers
    owner: Any

    @property
    def stepper(self) -> Any:
        return self.owner

    @property
    def state_holder(self) -> ZeroState:
        return ZeroState(self.owner)

    @property
    def grad_source(self) -> GradSource | None:
        return zero_grad_fragment

    @property
    def param_source(self) -> ParamSource | None:
        return None  # every rank holds the whole model

    @property
    def stepped_params(self) -> HasParamGroups:
        # Its torch optimizer holds flat partitions, which would make every block look like
        # one no optimizer steps: the model parameters it partitions instead.
        return ParamGroups([{"params": group} for group in zero_model_params(self.owner)])

    def check_checkpointable(self, checkpoint_dir: str | None) -> None:
        return None


@dataclass(frozen=True)
class ZeroState:
    """This rank's ZeRO-1/2 partition state (``PartitionedState``); see the module docstring."""

    owner: Any

    def states(self, model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
        return zero_states(model, self.owner)

    def load_states(
        self, model: torch.nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]
    ) -> None:
        set_zero_states(model, self.owner, model_sd, optim_sd)


def partition_key(owner: Any) -> str:
    """The optimizer-state key of this rank's partition (names the world size too)."""
    rank, world = zero_partition_rank(owner)
    return f"zero-rank-{rank:05d}-of-{world:05d}"


def zero_states(model: torch.nn.Module, owner: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's state dict and this rank's ZeRO partition state, holding the live tensors.

    Args:
        model: the DeepSpeed engine (or the module it wraps).
        owner: DeepSpeed's ZeRO-1/2 optimizer (``engine.optimizer``).

    Returns:
        (model state dict, ``{partition key: {"group-<i>": ...}}``).
    """
    inner = owner.optimizer
    # A checkpoint loads into the state tensors, so they must exist (a resume before any step).
    init_optim_state(inner)
    groups: dict[str, Any] = {}
    masters = zero_partitions(owner)
    for i, (group, master) in enumerate(zip(inner.param_groups, masters, strict=True)):
        flat = group["params"]
        if len(flat) != 1 or flat[0] is not master:
            raise RuntimeError(
                f"DeepSpeed's ZeRO param group {i} does not hold its master "
                "partition alone: a layout torchvitals does not checkpoint"
            )
        groups[f"group-{i}"] = {
            "master": master,
            "state": dict(inner.state.get(master, {})),
            "hparams": {k: v for k, v in group.items() if k != "params"},
        }
    return get_model_state_dict(model), {partition_key(owner): groups}


def set_zero_states(
    model: torch.nn.Module, owner: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any]
) -> None:
    """Load ``model_sd`` and ``optim_sd`` (shaped as ``zero_states`` returns them) in place.

    Raises:
        KeyError: ``optim_sd`` holds no state for this rank's partition (another world size).
    """
    set_model_state_dict(model, model_sd)
    key = partition_key(owner)
    if key not in optim_sd:
        raise KeyError(
            f"no DeepSpeed ZeRO optimizer state for {key} (saved: "
            f"{', '.join(sorted(optim_sd)) or 'none'}): a ZeRO checkpoint loads "
            "into the same number of partitions only"
        )
    saved, inner = optim_sd[key], owner.optimizer
    masters = zero_partitions(owner)
    for i, (group, master) in enumerate(zip(inner.param_groups, masters, strict=True)):
        mine = saved[f"group-{i}"]
        load_partition(inner, master, mine)
        group.update(mine["hparams"])


def load_partition(
    inner: torch.optim.Optimizer, master: torch.Tensor, saved: dict[str, Any]
) -> None:
    """Copy a saved fp32 master partition and the torch optimizer's state over it in place.

    Args:
        inner: the torch optimizer inside DeepSpeed's ZeRO optimizer.
        master: the live fp32 partition it steps (and keys its state by).
        saved: ``{"master": tensor, "state": {name: tensor or value}}``.
    """
    copy_in_place(master, saved["master"])
    live = inner.state.setdefault(master, {})
    for name, value in saved["state"].items():
        if isinstance(value, torch.Tensor) and isinstance(live.get(name), torch.Tensor):
            copy_in_place(live[name], value)
        else:
            live[name] = value


def copy_in_place(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` outside autograd; nothing when they are the same tensor (a restore
    from the live state dict itself)."""
    if dst is not src:
        with torch.no_grad():
            dst.copy_(src)
