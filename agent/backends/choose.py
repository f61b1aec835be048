"""Which backend the object passed to ``watch()`` gets: one per kind, chosen once.

    backend = choose(optimizer, log)     # TorchBackend, ContainerBackend, ZeroBackend, Zero3Backend

The chain ``optimizer`` -> ``.optimizer`` -> ... is walked once: a DeepSpeed ZeRO-1/2/3
optimizer in it owns the step and the gradients (its backend), any other wrapper is peeled to
the torch optimizer or container inside (``wrappers.unwrap_optimizer``), and DeepSpeed's other
optimizers, whose gradients live where torchvitals cannot read them, are refused rather than
reported as zeros.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import TorchvitalsError
from ..compat.deepspeed import is_deepspeed, is_zero3_optimizer, is_zero_optimizer, zero_loss_scaled
from .base import OptimizerBackend
from .optimizers import resolve
from .torch_optim import ContainerBackend, TorchBackend
from .wrappers import MAX_DEPTH, is_torch_optimizer, unwrap_optimizer
from .zero import ZeroBackend
from .zero3 import Zero3Backend, Zero3Partitions


def choose(optimizer: Any, log: logging.Logger | None = None) -> OptimizerBackend:
    """The backend of ``optimizer``, as passed to ``watch()``.

    Args:
        optimizer: a torch optimizer, a container of them (torchtitan's shape), or a wrapper
            holding either as ``.optimizer`` (accelerate's, DeepSpeed's ZeRO optimizer).
        log: where the note naming the wrappers peeled goes (at info), when there is one.

    Returns:
        The backend: ``ZeroBackend``/``Zero3Backend`` for a DeepSpeed ZeRO optimizer in the
        chain, else ``ContainerBackend`` or ``TorchBackend`` for what the chain holds.

    Raises:
        TorchvitalsError: a DeepSpeed optimizer torchvitals cannot read (ZeRO with fp16, its
            fp16/bf16 optimizers), or nothing in the chain is an optimizer.
    """
    owner = _partitioning_owner(optimizer)
    peeled = unwrap_optimizer(optimizer)
    inner = peeled.obj if log is None else peeled.logged(log)
    optimizers = resolve(inner)
    if owner is not None and is_zero3_optimizer(owner):
        return Zero3Backend(optimizers, owner, Zero3Partitions(owner))
    if owner is not None:
        return ZeroBackend(optimizers, owner)
    return ContainerBackend(optimizers) if optimizers.is_container else TorchBackend(optimizers)


def _partitioning_owner(obj: Any) -> Any:
    """The DeepSpeed ZeRO-1/2/3 optimizer in ``obj``'s chain (it steps and holds the gradients),
    or None when the chain reaches a torch optimizer (or ends) first."""
    inner = obj
    for _ in range(MAX_DEPTH + 1):
        zero = is_zero_optimizer(inner) or is_zero3_optimizer(inner)
        if zero and zero_loss_scaled(inner):
            # Its partitions hold loss-scaled gradients, and an overflow must reach its step
            # (which backs the scale off): not handled yet, refused rather than misread.
            raise TorchvitalsError(
                "torchvitals does not support DeepSpeed ZeRO with fp16 yet (its gradients are "
                "loss-scaled, and its overflow skip must run its own step); use bf16 or fp32"
            )
        if zero:
            return inner
        if is_torch_optimizer(inner):
            return None
        if is_deepspeed(inner):
            # DeepSpeed's fp16/bf16 optimizers: the gradients live in buffers this
            # version does not read; refused rather than reported as zeros.
            raise TorchvitalsError(
                f"torchvitals does not support DeepSpeed's {type(inner).__module__}."
                f"{type(inner).__qualname__} yet: its gradients live in DeepSpeed's own "
                "buffers, which torchvitals cannot read, so every norm would be missing. "
                "Supported: ZeRO stage 0 (fp32), 1, 2 and 3"
            )
        inner = getattr(inner, "optimizer", None)
    return None
