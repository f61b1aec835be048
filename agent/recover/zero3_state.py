"""DeepSpeed ZeRO-3's partitioned parameters and optimizer state, as checkpoints and snapshots
see them.

    model_sd, optim_sd = zero3_states(engine, zero3_optimizer)     # the live tensors (no copy)
    set_zero3_states(engine, zero3_optimizer, model_sd, optim_sd)  # loaded back in place

Under ZeRO-3 the parameters are partitioned too: outside a forward pass ``param.data`` is empty
(or, for the small "persistent" parameters DeepSpeed keeps whole, a gathered copy), and each
rank holds ``param.ds_tensor``, its partition. The optimizer holds this rank's fp32 master
partition of each sub-group (the flat tensor its torch optimizer steps; with fp32 training the
very buffer the parameter partitions are views of) and the torch optimizer's state over it.
None of that maps to DCP's parameter names, so everything is saved under this rank's partition
key (``zero_state.partition_key``)::

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

from typing import Any

import torch

from ..compat import (
    init_optim_state,
    zero3_group_of,
    zero3_masters,
    zero3_partition,
    zero3_regather,
    zero3_release_all,
)
from .zero_state import copy_in_place, load_partition, partition_key


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
        copy_in_place(zero3_partition(params[name]), value)
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
