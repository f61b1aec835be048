"""DeepSpeed's ZeRO-3 optimizer: its backend, this rank's partitions of each parameter and
gradient, and its partitioned state as checkpoints see it.

    backend = Zero3Backend(resolve(engine.optimizer.optimizer), engine.optimizer, partitions)
    model_sd, optim_sd = backend.state_holder.states(engine)   # the live tensors (no copy)
    backend.state_holder.load_states(engine, model_sd, optim_sd)   # loaded back in place

As under ZeRO-1/2 the guard takes the ZeRO optimizer's own ``step`` (it steps its torch
optimizer once per sub-group), and the gradients are read from its partitions; the parameters
are partitioned too, so the update ratio reads this rank's partition (``Zero3Partitions``).

Under ZeRO-3 the parameters are partitioned too: outside a forward pass ``param.data`` is empty
(or, for the small "persistent" parameters DeepSpeed keeps whole, a gathered copy), and each
rank holds ``param.ds_tensor``, its partition. The optimizer holds this rank's fp32 master
partition of each sub-group (the flat tensor its torch optimizer steps; with fp32 training the
very buffer the parameter partitions are views of) and the torch optimizer's state over it.
None of that maps to DCP's parameter names, so everything is saved under this rank's partition
key (``zero.partition_key``)::

    model: {"zero-rank-00001-of-00002": {"params": {"module.inp.weight": <ds_tensor>, ...},
                                         "buffers": {...}}}
    optim: {"zero-rank-00001-of-00002": {"sub-group-0": {"master": <flat fp32 partition>,
                                                         "state": {"exp_avg": ..., "step": ...}},
                                         "hparams": {"group-0": {"lr": ..., ...}, ...}}}

Each rank writes and reads only its own key, so the checkpoint loads into the same number of
partitions only (another world size: DCP's "missing key" names it). A restore follows
DeepSpeed's own checkpoint load: every parameter is released first (whole copies gathered from
the old partitions, by a forward, a prefetch or for a persistent parameter, are dropped), the
partitions and fp32 masters are copied in place (DeepSpeed's flat buffers and its torch
optimizer's state keys stay the same tensors), and the persistent parameters are gathered
again from the restored partitions, so the next forward sees the restored values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...errors import TorchvitalsError
from ..compat.deepspeed import (
    zero3_grads,
    zero3_group_of,
    zero3_masters,
    zero3_model_params,
    zero3_offloaded,
    zero3_partition,
    zero3_partition_start,
    zero3_regather,
    zero3_release_all,
)
from ..compat.pytorch import init_optim_state
from ..compat.wrapped import full_numel
from .base import GradSource, HasParamGroups, ParamGroups, ParamSource
from .optimizers import Optimizers
from .zero import copy_in_place, load_partition, partition_key


class Zero3Partitions:
    """This rank's partition of each parameter and of its gradient under DeepSpeed ZeRO-3,
    without the padding (the partitions of the ranks are disjoint and cover the whole).

    A parameter of ``n`` elements is cut into equal partitions of ``ds_tensor.ds_numel``; rank
    ``r`` of its partition group holds elements ``[r * size, (r + 1) * size)``, and what lies
    past ``n`` is padding: left uninitialised in the parameter's partition (it would swamp a
    norm), zero in the gradient's. The gradients are read from the lists the optimizer's own
    norm reads (``deepspeed.utils.safe_get_local_grad`` returns the same tensor, but waits on
    DeepSpeed's reduction stream once per parameter, a device sync each, and still returns it
    after the step consumed it).

    Args:
        optimizer: the ``DeepSpeedZeroOptimizer_Stage3``.
    """

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self._where = {
            id(p): (i, j)
            for i, group in enumerate(zero3_model_params(optimizer))
            for j, p in enumerate(group)
        }
        self._valid: dict[int, int] = {}

    def _length(self, param: torch.Tensor) -> int:
        """How many of this rank's partition elements are ``param``'s (the rest: padding)."""
        n = self._valid.get(id(param))
        if n is None:
            size, start = zero3_partition_start(param)
            n = self._valid[id(param)] = max(0, min(size, full_numel(param) - start))
        return n

    def param(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's values of ``param`` (a view of its partition; possibly empty)."""
        partition = zero3_partition(param)
        assert partition is not None, "a parameter the ZeRO-3 optimizer steps is partitioned"
        return partition.detach().narrow(0, 0, self._length(param))

    def grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of ``param``'s gradient, or None when the optimizer holds none now
        (before a backward pass, after its step, or with its optimizer offloaded to the CPU:
        the partitions then live in the offloaded fp32 buffers instead)."""
        where = self._where.get(id(param))
        if where is None:
            return None
        grads = zero3_grads(self._optimizer).get(where[0])
        return None if grads is None else grads[where[1]].narrow(0, 0, self._length(param))


@dataclass(frozen=True)
class Zero3Backend:
    """DeepSpeed's ZeRO-3 optimizer (``OptimizerBackend``).

    Args:
        optimizers: its torch optimizer (flat fp32 partitions, the learning rates).
        owner: the ZeRO-3 optimizer (``engine.optimizer``).
        partitions: where this rank's partitions of the parameters and gradients are read.
    """

    kind: ClassVar[str] = "zero3"
    optimizers: Optimizers
    owner: Any
    partitions: Zero3Partitions

    @property
    def stepper(self) -> Any:
        return self.owner

    @property
    def state_holder(self) -> Zero3State:
        return Zero3State(self.owner)

    @property
    def grad_source(self) -> GradSource | None:
        return self.partitions.grad

    @property
    def param_source(self) -> ParamSource | None:
        return self.partitions.param

    @property
    def stepped_params(self) -> HasParamGroups:
        return ParamGroups([{"params": group} for group in zero3_model_params(self.owner)])

    def check_checkpointable(self, checkpoint_dir: str | None) -> None:
        """Refuse a watchdog over an offloaded ZeRO-3 optimizer: its state or parameters live in
        DeepSpeed's offload buffers (CPU or NVMe), which the in-place restore does not cover."""
        if checkpoint_dir and zero3_offloaded(self.owner):
            raise TorchvitalsError(
                "torchvitals cannot checkpoint or roll back this DeepSpeed ZeRO-3 engine: its "
                "optimizer state or parameters are offloaded (offload_optimizer/offload_param). "
                "watch(engine, engine.optimizer) without checkpoint_dir (a non-finite step is "
                "then skipped on every rank), and checkpoint with DeepSpeed's "
                "engine.save_checkpoint"
            )


@dataclass(frozen=True)
class Zero3State:
    """This rank's ZeRO-3 partitions and optimizer state (``PartitionedState``); see the module
    docstring."""

    owner: Any

    def states(self, model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
        return zero3_states(model, self.owner)

    def load_states(
        self, model: torch.nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]
    ) -> None:
        set_zero3_states(model, self.owner, model_sd, optim_sd)


def zero3_states(model: torch.nn.Module, owner: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's partitions and this rank's ZeRO-3 optimizer state, holding the live tensors.

    Args:
        model: the DeepSpeed engine (or the module it wraps).
        owner: DeepSpeed's ZeRO-3 optimizer (``engine.optimizer``).

    Returns:
        (``{partition key: {"params", "buffers"}}``, ``{partition key: {"sub-group-<i>": ...,
        "hparams": ...}}``).
    """
    inner, masters = owner.optimizer, zero3_masters(owner)
    if not all(inner.state.get(m) for m in masters):
        _init_state(owner)  # a checkpoint loads into the state tensors: they must exist
    key = partition_key(owner)
    params = {
        name: zero3_partition(p)
        for name, p in model.named_parameters()
        if zero3_partition(p) is not None
    }
    buffers = dict(model.named_buffers())
    mine: dict[str, Any] = {"params": params}
    if buffers:
        mine["buffers"] = buffers
    optim: dict[str, Any] = {
        f"sub-group-{i}": {"master": m, "state": dict(inner.state[m])}
        for i, m in enumerate(masters)
    }
    optim["hparams"] = {
        f"group-{g}": {k: v for k, v in group.items() if k != "params"}
        for g, group in enumerate(inner.param_groups)
    }
    return {key: mine}, {key: optim}


def set_zero3_states(
    model: torch.nn.Module, owner: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any]
) -> None:
    """Load ``model_sd`` and ``optim_sd`` (shaped as ``zero3_states`` returns them) in place.

    Raises:
        KeyError: either holds no state for this rank's partition (another world size).
    """
    key = partition_key(owner)
    for what, sd in (("parameter", model_sd), ("optimizer", optim_sd)):
        if key not in sd:
            raise KeyError(
                f"no DeepSpeed ZeRO-3 {what} state for {key} (saved: "
                f"{', '.join(sorted(sd)) or 'none'}): a ZeRO checkpoint loads into "
                "the same number of partitions only"
            )
    zero3_release_all(owner)
    saved_model, saved_optim, inner = model_sd[key], optim_sd[key], owner.optimizer
    params = dict(model.named_parameters())
    for name, value in saved_model["params"].items():
        partition = zero3_partition(params[name])
        assert partition is not None, f"{name} was saved as this rank's ZeRO-3 partition"
        copy_in_place(partition, value)
    buffers = dict(model.named_buffers())
    for name, value in saved_model.get("buffers", {}).items():
        copy_in_place(buffers[name], value)
    for i, master in enumerate(zero3_masters(owner)):
        load_partition(inner, master, saved_optim[f"sub-group-{i}"])
    for g, group in enumerate(inner.param_groups):
        group.update(saved_optim["hparams"][f"group-{g}"])
    zero3_regather(owner)


def _init_state(owner: Any) -> None:
    """Give the torch optimizer its state over the fp32 masters (one step at learning rate 0
    with zero gradients), with the masters in its param groups as DeepSpeed's step puts them
    there, and out again after (DeepSpeed keeps those lists empty between its steps)."""
    inner = owner.optimizer
    for master, group in zip(zero3_masters(owner), zero3_group_of(owner), strict=True):
        inner.param_groups[group]["params"].append(master)
    try:
        init_optim_state(inner)
    finally:
        for group in inner.param_groups:
            group["params"] = []
