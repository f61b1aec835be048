"""DeepSpeed's names torchvitals reads: its ZeRO-1/2 and ZeRO-3 optimizers' partitions and the
engine's clipping. Where each kind keeps what, and what torchvitals does with it, is the
optimizer backends' (``agent/backends/zero.py``, ``zero3.py``); this module only reaches them.

    is_zero_optimizer(engine.optimizer)        # ZeRO stage 1/2 (is_zero3_optimizer: stage 3)
    zero_grad_fragment(param)                  # this rank's fragment of param's gradient

Nothing here imports DeepSpeed: each test looks at the object it is handed, and ``problems()``
reads DeepSpeed's source only when it is installed (that the stage-3 optimizer still fills, norms
and steps the lists named here, that a parameter's partition is still where it is read).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

PACKAGE = "deepspeed"
"""DeepSpeed's top-level package: every object of its own lives in a module under it."""

# ---------------------------------------------------------------- ZeRO-1/2

ZERO_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
"""Where DeepSpeed's ZeRO-1/2 optimizer, ``DeepSpeedZeroOptimizer``, lives."""
ZERO_PARTITIONED_GRADS = "averaged_gradients"
"""DeepSpeed ZeRO-1/2 optimizer: each param group's gradient partition of this rank, from the
end of the backward pass until its ``step`` consumes it."""
ZERO_GROUPS = "bit16_groups"
"""DeepSpeed ZeRO-1/2 optimizer: the model parameters it steps, per param group."""
ZERO_MASTER_PARTITIONS = "single_partition_of_fp32_groups"
"""DeepSpeed ZeRO-1/2 optimizer: this rank's fp32 master partition of each param group, the
flat tensor its torch optimizer steps (and holds the state of)."""


def is_deepspeed(obj: Any) -> bool:
    """Whether ``obj`` is an object of DeepSpeed's own (its class lives in DeepSpeed)."""
    return type(obj).__module__.startswith(PACKAGE + ".")


def is_zero_optimizer(obj: Any) -> bool:
    """DeepSpeed's ZeRO stage 1/2 optimizer (it keeps the gradients in its own partitions)."""
    return (
        type(obj).__module__ == ZERO_MODULE
        and hasattr(obj, ZERO_PARTITIONED_GRADS)
        and hasattr(obj, ZERO_GROUPS)
    )


def zero_loss_scaled(optimizer: Any) -> bool:
    """DeepSpeed's ZeRO optimizer trains in fp16: its partitions hold loss-scaled gradients."""
    return getattr(optimizer, "dtype", None) == torch.float16


def zero_model_params(optimizer: Any) -> list[list[torch.Tensor]]:
    """The model parameters DeepSpeed's ZeRO-1/2 optimizer steps, per param group (its torch
    optimizer holds flat partitions instead)."""
    return [list(group) for group in getattr(optimizer, ZERO_GROUPS)]


def zero_partitions(optimizer: Any) -> list[torch.Tensor]:
    """This rank's fp32 master partition of each param group of DeepSpeed's ZeRO-1/2 optimizer,
    in the order of its torch optimizer's param groups."""
    return list(getattr(optimizer, ZERO_MASTER_PARTITIONS))


def zero_partition_rank(optimizer: Any) -> tuple[int, int]:
    """``(this rank's partition, how many)`` of DeepSpeed's ZeRO optimizer (its data-parallel
    group's rank and size)."""
    group = optimizer.dp_process_group
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def zero_grad_fragment(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's fragment of ``param``'s gradient under DeepSpeed ZeRO-1/2, or None when this
    rank holds none of it (the fragments of the ranks are disjoint and cover the gradient) or
    when the optimizer holds no gradient now (before a backward pass, after its step)."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    try:
        return mapping.get_lp_grad_fragment(param._index_in_param_group)  # type: ignore[attr-defined]
    except ValueError:  # "Gradients are only available ... before engine step"
        return None


# ---------------------------------------------------------------- ZeRO-3

ZERO3_MODULE = "deepspeed.runtime.zero.stage3"
"""Where DeepSpeed's ZeRO-3 optimizer, ``DeepSpeedZeroOptimizer_Stage3``, lives."""
ZERO3_GRADS = "averaged_gradients"
"""DeepSpeed ZeRO-3 optimizer: per sub-group, the list of this rank's gradient partitions of the
sub-group's parameters (``fp16_groups[i]``, in order), set after each backward pass and emptied
by its step. Its own norm (``get_global_grad_norm()``) is computed from exactly these lists."""
ZERO3_GROUPS = "fp16_groups"
"""DeepSpeed ZeRO-3 optimizer: the model parameters it steps, per sub-group."""
ZERO3_MASTERS = "fp32_partitioned_groups_flat"
"""DeepSpeed ZeRO-3 optimizer: this rank's fp32 master partition of each sub-group, the flat
tensor its torch optimizer steps and keys its state by (with fp32 training, the very buffer the
parameters' partitions are views of)."""
ZERO3_SUB_GROUP_TO_GROUP = "sub_group_to_group_id"
"""DeepSpeed ZeRO-3 optimizer: the torch optimizer's param group each sub-group steps in (its
torch optimizer's ``params`` lists are empty outside its step)."""


def is_zero3_optimizer(obj: Any) -> bool:
    """DeepSpeed's ZeRO stage 3 optimizer (parameters, gradients and state all partitioned)."""
    return (
        type(obj).__module__ == ZERO3_MODULE
        and hasattr(obj, ZERO3_GRADS)
        and hasattr(obj, ZERO3_GROUPS)
    )


def zero3_model_params(optimizer: Any) -> list[list[torch.Tensor]]:
    """The model parameters DeepSpeed's ZeRO-3 optimizer steps, per sub-group."""
    return [list(group) for group in getattr(optimizer, ZERO3_GROUPS)]


def zero3_grads(optimizer: Any) -> dict[int, list[torch.Tensor]]:
    """Per sub-group, this rank's gradient partitions of its parameters (empty after a step)."""
    return getattr(optimizer, ZERO3_GRADS)


def zero3_partition(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's whole partition of a ZeRO-3 parameter (``ds_tensor``, padding included:
    what DeepSpeed gathers from), or None for a parameter DeepSpeed does not partition."""
    return getattr(param, "ds_tensor", None)


def zero3_partition_start(param: Any) -> tuple[int, int]:
    """``(elements per partition, where this rank's starts)`` of a ZeRO-3 parameter: rank ``r``
    of its partition group holds elements ``[r * size, (r + 1) * size)`` of the whole."""
    size = param.ds_tensor.ds_numel
    return size, size * dist.get_rank(group=param.ds_process_group)


def zero3_masters(optimizer: Any) -> list[torch.Tensor]:
    """This rank's fp32 master partition of each sub-group of DeepSpeed's ZeRO-3 optimizer."""
    return list(getattr(optimizer, ZERO3_MASTERS))


def zero3_group_of(optimizer: Any) -> list[int]:
    """The torch param group each sub-group of DeepSpeed's ZeRO-3 optimizer steps in."""
    owner = getattr(optimizer, ZERO3_SUB_GROUP_TO_GROUP)
    return [owner[i] for i in range(len(zero3_masters(optimizer)))]


def zero3_offloaded(optimizer: Any) -> bool:
    """Whether this ZeRO-3 optimizer keeps its state or parameters in DeepSpeed's offload
    buffers (CPU or NVMe) instead of its partitions."""
    return any(
        getattr(optimizer, name, False)
        for name in ("offload_optimizer", "swap_optimizer", "offload_param")
    )


def zero3_release_all(optimizer: Any) -> None:
    """Partition every parameter again (the whole copies a forward gathered, prefetched ones
    and the persistent small parameters dropped): what DeepSpeed does before loading its own
    checkpoint, so nothing gathered from the old partitions survives a restore."""
    optimizer.checkpoint_event_prologue()


def zero3_regather(optimizer: Any) -> None:
    """Drop the secondary (hpZ) partition copies and gather the persistent parameters again
    from the partitions: what DeepSpeed does after loading its own checkpoint."""
    optimizer.checkpoint_event_epilogue()


# ---------------------------------------------------------------- the engine's clipping

ENGINE_MODULE = "deepspeed.runtime.engine"
"""The module whose ``clip_grad_norm_`` global DeepSpeed's engine clips through (ZeRO off)."""
ENGINE_CLIP = "clip_grad_norm_"


def loaded_engine_module() -> ModuleType | None:
    """DeepSpeed's engine module when DeepSpeed is loaded and clips through it, else None."""
    engine = sys.modules.get(ENGINE_MODULE)
    return engine if engine is not None and callable(getattr(engine, ENGINE_CLIP, None)) else None


# ---------------------------------------------------------------- the check


def problems() -> list[str]:
    """The DeepSpeed names above that do not hold in the installed DeepSpeed (none installed:
    nothing to check)."""
    if importlib.util.find_spec(PACKAGE) is None:
        return []
    out = _zero_problems() + _zero3_problems()
    if not callable(getattr(importlib.import_module(ENGINE_MODULE), ENGINE_CLIP, None)):
        out.append(f"{ENGINE_MODULE}.{ENGINE_CLIP} is gone")
    return out


def _zero_problems() -> list[str]:
    source = inspect.getsource(importlib.import_module(ZERO_MODULE))
    fragments = inspect.getsource(importlib.import_module("deepspeed.utils.tensor_fragment"))
    out = [
        f"{ZERO_MODULE}.DeepSpeedZeroOptimizer.{name} is gone"
        for name in (
            ZERO_PARTITIONED_GRADS,
            ZERO_GROUPS,
            ZERO_MASTER_PARTITIONS,
            "dp_process_group",
        )
        if f"self.{name}" not in source
    ]
    if "_hp_mapping" not in source or "def get_lp_grad_fragment(" not in fragments:
        out.append(f"{ZERO_MODULE}: a parameter's gradient fragment is no longer _hp_mapping's")
    return out


def _zero3_problems() -> list[str]:
    stage3 = importlib.import_module(ZERO3_MODULE)
    cls = getattr(stage3, "DeepSpeedZeroOptimizer_Stage3", None)
    if cls is None:
        return [f"{ZERO3_MODULE}.DeepSpeedZeroOptimizer_Stage3 is gone"]
    # Its methods are wrapped without functools.wraps (NVTX ranges): read the module's source.
    source, where = inspect.getsource(stage3), f"{ZERO3_MODULE}.DeepSpeedZeroOptimizer_Stage3"
    out = []
    if f"self.{ZERO3_GRADS}[i] = [" not in source:
        out.append(f"{where}: the backward epilogue no longer fills {ZERO3_GRADS}")
    if f"get_grad_norm_direct(self.{ZERO3_GRADS}[i], self.{ZERO3_GROUPS}[i])" not in source:
        out.append(f"{where}: its norm no longer reads {ZERO3_GRADS} per {ZERO3_GROUPS}")
    if "self.dtype = " not in source:
        out.append(f"{where}.dtype is gone")
    for name in ("checkpoint_event_prologue", "checkpoint_event_epilogue"):
        if not callable(getattr(cls, name, None)):
            out.append(f"{where}.{name} is gone")
    if (
        f"self.{ZERO3_MASTERS}[sub_group_id]" not in source
        or f"self.{ZERO3_SUB_GROUP_TO_GROUP}[sub_group_id]" not in source
    ):
        out.append(
            f"{where}: its step no longer steps {ZERO3_MASTERS} in the param group "
            f"{ZERO3_SUB_GROUP_TO_GROUP} names"
        )
    if "self._partition_all_parameters()" not in inspect.getsource(
        cls.checkpoint_event_prologue
    ) or "all_gather(self.persistent_parameters)" not in inspect.getsource(
        cls.checkpoint_event_epilogue
    ):
        out.append(
            f"{where}.checkpoint_event_prologue/epilogue no longer release and gather "
            "the parameters again"
        )
    parts = inspect.getsource(
        importlib.import_module("deepspeed.runtime.zero.partition_parameters")
    )
    if not all(
        line in parts
        for line in (
            "param.ds_tensor.ds_numel = partition_size",
            "start = partition_size * self._partition_rank(param)",
        )
    ):
        out.append(
            "deepspeed.runtime.zero.partition_parameters: a ZeRO-3 parameter's partition "
            "is no longer ds_tensor[:ds_numel - rank * ds_tensor.ds_numel]"
        )
    return out
