"""How a wrapped or partitioned model looks from outside: the module a wrapper holds, the
prefixes wrappers put before parameter names, a partitioned parameter's whole size.

    inner = wrapped_module(ddp_model)          # the module DDP holds (None: wraps nothing)
    full_numel(param)                          # a ZeRO-3 parameter's whole size, not 0

DDP, FSDP1, ``torch.compile`` and ``checkpoint_wrapper`` each hold the user's module under a
name of their own and prefix its parameter names with it; DeepSpeed's engine holds it as
``.module`` too, and under ZeRO-3 a parameter's ``numel()`` is 0 outside a forward pass.
``problems()`` checks that the prefixes are still the names torch's wrappers use.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper
from torch.distributed.fsdp import _common_utils

from .versions import missing

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
"""What DDP, torch.compile, FSDP1 and checkpoint_wrapper put before a wrapped module's
parameter names."""
WHOLE_NUMEL = "ds_numel"
"""A DeepSpeed ZeRO-3 parameter's attribute holding its whole element count."""


def compiled_inner(model: Any) -> Any:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds, or None."""
    return getattr(model, "_orig_mod", None)


def wrapped_module(model: Any) -> Any:
    """The module a wrapper holds (DDP's, FSDP1's, DeepSpeed's engine's ``.module``,
    ``torch.compile``'s original), or None for a module that wraps nothing."""
    inner = getattr(model, "module", None) or compiled_inner(model)
    return inner if isinstance(inner, torch.nn.Module) else None


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter: a ZeRO-3 parameter's ``ds_numel`` (its ``numel()`` is
    0 while partitioned), any other's ``numel()`` (a DTensor's is its global one)."""
    numel = getattr(param, WHOLE_NUMEL, None)
    return int(numel) if numel is not None else param.numel()


def problems() -> list[str]:
    """Each wrapper name above that torch's wrappers no longer use, as a sentence naming it."""
    out = []
    # Imported here, not at the top: it loads torch._dynamo (seconds), which only this check and
    # compiled models need.
    from torch._dynamo.eval_frame import OptimizedModule

    if "self._orig_mod" not in inspect.getsource(OptimizedModule.__init__):
        out.append(missing("torch._dynamo.eval_frame.OptimizedModule", "_orig_mod"))
    for module, name in (
        (checkpoint_wrapper, "_CHECKPOINT_WRAPPED_MODULE"),
        (_common_utils, "FSDP_WRAPPED_MODULE"),
    ):
        if f"{getattr(module, name, None)}." not in WRAPPER_PREFIXES:
            out.append(missing(module.__name__, name))
    return out
