"""What ``watch()`` guards when it is handed a framework's wrapper instead of a torch optimizer.

    optimizer, note = unwrap_optimizer(accelerated_optimizer)   # the torch optimizer inside
    scheduler, note = unwrap_scheduler(accelerated_scheduler)   # what the agent checkpoints

    owner = step_owner(engine.optimizer)                        # whose step the guard takes

``accelerator.prepare`` returns an ``AcceleratedOptimizer`` and an ``AcceleratedScheduler``;
DeepSpeed's engine holds a ZeRO optimizer. None of them is a working ``torch.optim.Optimizer``,
but each holds one as ``.optimizer``. Accelerate's forwards its step to it only when a real step
is due (``accumulate``), so the guard goes on that inner optimizer. DeepSpeed's ZeRO-1/2
optimizer clips its partitioned gradients and then steps the inner one once per param group
(ZeRO-3's once per sub-group), so the guard goes on the ZeRO optimizer's own ``step`` instead,
and the gradients are read from its partitions (``grad_source``); under ZeRO-3 the parameters
are partitioned as well, and the update ratio reads this rank's partition (``param_source``).
Anything that is neither an optimizer nor a wrapper of one, and DeepSpeed optimizers whose
gradients cannot be read, are refused at ``watch()`` with what it accepts.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from ..errors import TorchvitalsError
from .compat import (
    Zero3Partitions,
    is_zero3_optimizer,
    is_zero_optimizer,
    zero3_model_params,
    zero3_unsupported_checkpoint,
    zero_grad_fragment,
    zero_loss_scaled,
    zero_model_params,
)
from .optimizers import is_container

MAX_DEPTH = 4
"""Wrappers peeled at most (accelerate around DeepSpeed around torch is three)."""


class Unwrapped(NamedTuple):
    """What the agent uses, and a line for the user when it is not what they passed."""

    obj: Any
    """The torch optimizer to guard, or the scheduler to checkpoint and step."""
    note: str | None
    """Names the wrapper(s) peeled; None when the object was used as passed."""


def _name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def unwrap_optimizer(obj: Any) -> Unwrapped:
    """The ``torch.optim.Optimizer`` that ``obj`` is, or that its ``.optimizer`` chain holds.

    Args:
        obj: a torch optimizer, or a wrapper exposing one as ``.optimizer`` (accelerate's
            ``AcceleratedOptimizer``, DeepSpeed's ZeRO optimizer, accelerate around DeepSpeed).

    Returns:
        The torch optimizer and a note naming the wrappers peeled (None if ``obj`` was one).

    Raises:
        TorchvitalsError: ``obj`` is neither, named with what ``watch()`` accepts.
    """
    chain, inner = [], obj
    # Peeled whenever it holds one: accelerate's wrapper subclasses torch.optim.Optimizer
    # without being initialised as one (no hooks, no state of its own). A container of
    # optimizers (torchtitan's shape) is kept whole: ``optimizers.resolve`` opens it.
    while not (_is_torch_optimizer(inner) or is_container(inner)):
        nested = getattr(inner, "optimizer", None)
        if nested is None or nested is inner or len(chain) >= MAX_DEPTH:
            raise TorchvitalsError(
                f"torchvitals.watch() needs a torch.optim.Optimizer, a wrapper that holds one "
                f"as .optimizer (accelerate's AcceleratedOptimizer, DeepSpeed's ZeRO optimizer), "
                f"or a container of them (torchtitan's OptimizersContainer; for its Trainer use "
                f"torchvitals.watch_torchtitan(trainer)); got {_name(obj)}"
                + (
                    f" (through {' -> '.join(_name(c) for c in chain[1:] + [inner])})"
                    if chain
                    else ""
                )
                + ", which holds no torch optimizer. Pass the optimizer that steps the model."
            )
        chain.append(inner)
        inner = nested
    if not chain:
        return Unwrapped(inner, None)
    return Unwrapped(
        inner,
        "torchvitals: guarding the torch optimizer "
        f"{_name(inner)} inside {' -> '.join(_name(c) for c in chain)}: "
        "stepping the wrapper steps it through torchvitals",
    )


def unwrap_scheduler(obj: Any) -> Unwrapped:
    """The LR scheduler the agent checkpoints, restores and (from ``agent.step``) steps.

    A wrapper is kept as passed when it forwards ``state_dict``/``load_state_dict`` (accelerate's
    ``AcceleratedScheduler`` does, and its ``step`` applies accelerate's own rules: steps only
    when the gradients were synchronised, once per process). A wrapper without them is peeled
    through its ``.scheduler``.

    Args:
        obj: None, a scheduler, or a wrapper holding one as ``.scheduler``.

    Returns:
        The scheduler (None stays None) and a note when one was peeled.

    Raises:
        TorchvitalsError: ``obj`` has no ``step``/``state_dict``/``load_state_dict`` and wraps
            nothing that has them.
    """
    chain, inner = [], obj
    while inner is not None and not _schedules(inner):
        nested = getattr(inner, "scheduler", None)
        if nested is None or nested is inner or len(chain) >= MAX_DEPTH:
            raise TorchvitalsError(
                f"torchvitals.watch()'s scheduler must have step(), state_dict() and "
                f"load_state_dict() (a torch LR scheduler, accelerate's AcceleratedScheduler), "
                f"or hold one as .scheduler; got {_name(obj)}"
            )
        chain.append(inner)
        inner = nested
    if not chain:
        return Unwrapped(inner, None)
    return Unwrapped(
        inner,
        f"torchvitals: checkpointing the scheduler {_name(inner)} inside "
        f"{' -> '.join(_name(c) for c in chain)}",
    )


def _is_torch_optimizer(obj: Any) -> bool:
    """A torch optimizer initialised as one (its own step hooks), not a subclass wrapping one."""
    return (
        isinstance(obj, torch.optim.Optimizer)
        and "_optimizer_step_pre_hooks" in vars(obj)
        and not isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)
    )


def _schedules(obj: Any) -> bool:
    return all(callable(getattr(obj, n, None)) for n in ("step", "state_dict", "load_state_dict"))


def unwrap_all(optimizer: Any, scheduler: Any, log: Any) -> tuple[torch.optim.Optimizer, Any]:
    """``unwrap_optimizer`` and ``unwrap_scheduler`` for ``watch()``, each note logged once.

    Args:
        optimizer, scheduler: as passed to ``watch()``.
        log: a logger (its ``info``) for the notes.

    Returns:
        The torch optimizer to guard and the scheduler to checkpoint.
    """
    opt, sched = unwrap_optimizer(optimizer), unwrap_scheduler(scheduler)
    for note in (opt.note, sched.note):
        if note is not None:
            log.info(note)
    return opt.obj, sched.obj


def step_owner(obj: Any) -> Any:
    """The object whose ``step`` the guard replaces, for the optimizer ``obj`` passed to watch.

    DeepSpeed's ZeRO-1/2/3 optimizer in ``obj``'s chain: its ``step`` checks for overflow, clips
    the partitioned gradients and steps its torch optimizer once per param group, so the agent's
    step runs around all of it (the gradients measured before it clips, one step however many
    groups). Otherwise the torch optimizer itself (accelerate's wrapper forwards its step to it
    only when the gradients were synchronised).
    """
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
        if _is_torch_optimizer(inner):
            return inner
        if type(inner).__module__.startswith("deepspeed."):
            # DeepSpeed's fp16/bf16 optimizers: the gradients live in buffers this
            # version does not read; refused rather than reported as zeros.
            raise TorchvitalsError(
                f"torchvitals does not support DeepSpeed's {_name(inner)} yet: its gradients "
                f"live in DeepSpeed's own buffers, which torchvitals cannot read, so every norm "
                f"would be missing. Supported: ZeRO stage 0 (fp32), 1, 2 and 3"
            )
        inner = getattr(inner, "optimizer", None)
    return unwrap_optimizer(obj).obj


def state_holder(owner: Any, optimizer: Any) -> Any:
    """What checkpoints and rollbacks read the optimizer state from and write it back to:
    DeepSpeed's ZeRO-1/2/3 optimizer (its partitions and its torch optimizer's state over them,
    see ``recover/zero_state.py`` and ``recover/zero3_state.py``), otherwise the torch optimizer
    (or container) ``optimizer``."""
    return owner if is_zero_optimizer(owner) or is_zero3_optimizer(owner) else optimizer


def check_checkpointable(owner: Any, checkpoint_dir: str | None) -> None:
    """Refuse, at ``watch()``, a watchdog this optimizer's state cannot go through.

    Raises:
        TorchvitalsError: DeepSpeed ZeRO-3 with ``checkpoint_dir`` and its optimizer state or
            parameters offloaded (to the CPU or NVMe): they live in DeepSpeed's offload
            buffers, which the in-place restore of ``recover/zero3_state.py`` does not cover.
    """
    why = zero3_unsupported_checkpoint(owner) if is_zero3_optimizer(owner) else None
    if checkpoint_dir and why:
        raise TorchvitalsError(
            f"torchvitals cannot checkpoint or roll back this DeepSpeed ZeRO-3 engine: {why}. "
            "watch(engine, engine.optimizer) without checkpoint_dir (a non-finite step is then "
            "skipped on every rank), and checkpoint with DeepSpeed's engine.save_checkpoint"
        )


def grad_source(owner: Any) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """Where the gradients are read when they are not in ``param.grad``: this rank's fragment
    of DeepSpeed ZeRO-1/2's partitions, or its partition under ZeRO-3 (None: ``param.grad``)."""
    if is_zero3_optimizer(owner):
        return Zero3Partitions(owner).grad
    return zero_grad_fragment if is_zero_optimizer(owner) else None


def param_source(owner: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Where this rank's values of a parameter are read when the parameter itself is not
    whole on every rank: its partition under DeepSpeed ZeRO-3 (None: the parameter)."""
    return Zero3Partitions(owner).param if is_zero3_optimizer(owner) else None


class ParamGroups(NamedTuple):
    """Stands for an optimizer where only its model parameters are read (the wiring check)."""

    param_groups: list[dict[str, Any]]


def stepped_params(owner: Any, optimizer: torch.optim.Optimizer) -> Any:
    """What holds the model parameters a step updates, as ``param_groups``: the torch optimizer,
    or for DeepSpeed's ZeRO-1/2/3 the model parameters it partitions (its torch optimizer holds
    flat partitions, which would make every block look like one no optimizer steps)."""
    if is_zero_optimizer(owner) or is_zero3_optimizer(owner):
        groups = zero_model_params(owner) if is_zero_optimizer(owner) else zero3_model_params(owner)
        return ParamGroups([{"params": group} for group in groups])
    return optimizer
