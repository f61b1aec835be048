"""The model's and optimizers' state dicts, as checkpoints and in-memory snapshots see them.

    model_sd, optim_sd = get_states(model, optimizer)          # the live tensors (no copy)
    set_states(model, optimizer, model_sd, optim_sd)           # loaded back in place

``torch.distributed.checkpoint.state_dict`` maps each parameter to its state-dict key by module
path, which fails on a model whose state-dict hooks rename parameters (a fused QKV projection
saved as separate ``wq``/``wk``/``wv``: "object has no attribute 'wq'"). Such a model's own
``state_dict()``/``load_state_dict()`` run its hooks both ways, which is how torchtitan's own
checkpointer saves it; the optimizer state is keyed by parameter name and does not care.
Every other model keeps the DCP path (wrapper prefixes stripped, FSDP2 shards as DTensors).
A partitioned optimizer's state maps to no parameter name (DeepSpeed ZeRO's flat partitions):
its backend hands over a ``PartitionedState`` as the optimizer, which says itself what to save
and loads it back (``agent/backends``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from ..backends.base import PartitionedState
from ..backends.optimizers import resolve
from ..compat.wrapped import WRAPPER_PREFIXES
from ..measure.blocks import unwrap


def get_states(model: torch.nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizers' state dicts, holding the live tensors where they can.

    Args:
        model: the (possibly wrapped or sharded) model.
        optimizer: its optimizer, a container of optimizers (see ``optimizers.resolve``), or
            a backend's ``PartitionedState``.

    Returns:
        (model state dict, optimizer state dict).
    """
    if isinstance(optimizer, PartitionedState):
        return optimizer.states(model)
    optims, options = _target(optimizer)
    inner = unwrap(model)
    own = inner.state_dict()
    if not _renamed(inner, own):
        return get_state_dict(model, optims, options=options)
    return own, get_optimizer_state_dict(model, optims, options=options)


def set_states(
    model: torch.nn.Module, optimizer: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any]
) -> None:
    """Load ``model_sd`` and ``optim_sd`` (shaped as ``get_states`` returns them) in place."""
    if isinstance(optimizer, PartitionedState):
        optimizer.load_states(model, model_sd, optim_sd)
        return
    optims, options = _target(optimizer)
    inner = unwrap(model)
    if not _renamed(inner, model_sd):
        set_state_dict(
            model, optims, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
        )
        return
    inner.load_state_dict(model_sd, strict=True)
    set_optimizer_state_dict(model, optims, optim_sd, options=options)


def _target(optimizer: Any) -> tuple[Any, StateDictOptions | None]:
    """The optimizers as DCP takes them, and its options.

    Several optimizers are flattened (one key per parameter and state, as torchtitan stores
    them): DCP's nested form gives each optimizer the whole dict back when no optimizer holds
    state yet (plain SGD), and the first one then refuses the other's param groups.
    """
    optimizers = resolve(optimizer)
    if not optimizers.is_container:
        return optimizers.state_target(), None
    return optimizers.state_target(), StateDictOptions(flatten_optimizer_state_dict=True)


def _renamed(model: torch.nn.Module, state: dict[str, Any]) -> bool:
    """Whether ``state`` holds keys that name no parameter or buffer (a hook renamed them)."""
    names = {_strip(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    names |= {_strip(n) for n, _ in model.named_buffers(remove_duplicate=False)}
    return any(_strip(k) not in names for k in state)


_WRAPPERS = {prefix.rstrip(".") for prefix in WRAPPER_PREFIXES}


def _strip(name: str) -> str:
    """``name`` without the wrappers' path components (both sides alike)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)
