"""torch's private names torchvitals reads or writes: the scaler, the LR schedulers' markers,
clipping, the multi-tensor kernels, the state-dict helpers, the pipeline schedule's loss.

    from torchvitals.agent.compat.pytorch import foreach_norm, scaler_found_inf

GradScaler's per-optimizer state and its no-sync scale accessor, the LR schedulers' "the
optimizer stepped" markers, the private function ``clip_grad_norm_`` scales gradients through,
the state-dict copy helpers: torch does not promise to keep any of them. A name bound below that
is gone refuses the import (``versions.bind``); an instance attribute is checked by
``problems()``, which builds the small objects that hold one (a GradScaler, an optimizer with a
scheduler) and reads torch's source where a call is what matters.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
import torch.optim.lr_scheduler
from torch.amp import grad_scaler
from torch.distributed import _state_dict_utils
from torch.distributed.checkpoint import state_dict as _dcp_state_dict
from torch.nn.modules import batchnorm, dropout

from .versions import bind, missing

clip_grad = torch.nn.utils.clip_grad
"""The module whose global ``clip_grad_norm_`` calls to scale gradients (patched there)."""
CLIP_SCALE = "_clip_grads_with_norm_"
"""``clip_grad_norm_`` computes the total norm, then calls this module global to scale."""
bind(clip_grad, CLIP_SCALE, "torch.nn.utils.clip_grad")
bind(torch.nn.utils, "clip_grads_with_norm_", "torch.nn.utils")

foreach_norm = bind(torch, "_foreach_norm", "torch")
foreach_mul = bind(torch, "_foreach_mul", "torch")
foreach_mul_ = bind(torch, "_foreach_mul_", "torch")
foreach_sub_ = bind(torch, "_foreach_sub_", "torch")
"""torch's multi-tensor kernels: one launch for a list of tensors."""

copy_state_dict = bind(_state_dict_utils, "_copy_state_dict", "torch.distributed._state_dict_utils")
create_cpu_state_dict = bind(
    _state_dict_utils, "_create_cpu_state_dict", "torch.distributed._state_dict_utils"
)
"""What torch's own async checkpointing stages with (pinned host copies, one pass)."""

init_optim_state = bind(
    _dcp_state_dict, "_init_optim_state", "torch.distributed.checkpoint.state_dict"
)
"""Gives an optimizer with no state yet its state tensors (one step at learning rate 0 with zero
gradients), so a checkpoint loads into them: what DCP's own optimizer state dict does first."""

BatchNorm = bind(batchnorm, "_BatchNorm", "torch.nn.modules.batchnorm")
DropoutNd = bind(dropout, "_DropoutNd", "torch.nn.modules.dropout")
"""The bases of every BatchNorm and Dropout variant."""

OptState = bind(grad_scaler, "OptState", "torch.amp.grad_scaler")
GradScaler = grad_scaler.GradScaler

PIPELINE_LOSS = "_compute_loss"
"""The method a ``torch.distributed.pipelining`` schedule computes each microbatch's loss with on
the last stage (through the loss function it was built with, captured at build time). Its
metadata inference on the first step calls that loss function directly on stand-in outputs, not
through this method, so only real microbatch losses pass here."""


def scaler_stage_unscaled(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` already ran this step."""
    return scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED


def scaler_found_inf(scaler: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The scaler's per-device "found Inf/NaN" flags for ``optimizer``'s step; ``scaler.step``
    skips the step and ``scaler.update`` backs off when any is nonzero."""
    return list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())


def scaler_scale_async(scaler: Any) -> torch.Tensor:
    """The scaler's current scale as a device tensor, without the sync ``get_scale()`` makes."""
    return scaler._get_scale_async()


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch's LR schedulers the optimizer stepped (their ``step`` warns otherwise)."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def mark_step_wrapped(fn: Any) -> None:
    """Tell torch's LR schedulers ``fn`` (an ``optimizer.step``) already marks its steps, so
    they do not wrap it again."""
    fn._wrapped_by_lr_sched = True


DDP_LOCALIZED = "_st_info"
"""Set on each parameter by torch's DDP + tensor parallel workaround
(``torch.distributed.tensor.parallel.ddp``): a DTensor turned into a plain tensor of its local
piece, the placement kept aside until the forward pass."""


def ddp_localized(model: torch.nn.Module) -> bool:
    """Whether DDP replaced tensor-parallel DTensor parameters by their local pieces."""
    return any(hasattr(p, DDP_LOCALIZED) for p in model.parameters())


def tensor_version(t: torch.Tensor) -> int:
    """Autograd's in-place modification counter of ``t``."""
    return t._version


def problems() -> list[str]:
    """Each private torch name above that does not hold in the installed torch, as a sentence
    naming it; empty when all hold."""
    out: list[str] = []

    def expect(ok: bool, where: str, name: str) -> None:
        if not ok:
            out.append(missing(where, name))

    scaler = GradScaler("cpu", enabled=True)
    state = scaler._per_optimizer_states[0] if hasattr(scaler, "_per_optimizer_states") else {}
    expect(bool(state), "GradScaler", "_per_optimizer_states")
    expect(
        set(state) >= {"stage", "found_inf_per_device"},
        "GradScaler._per_optimizer_states[]",
        "stage/found_inf_per_device",
    )
    expect(hasattr(OptState, "UNSCALED"), "torch.amp.grad_scaler.OptState", "UNSCALED")
    expect(callable(getattr(scaler, "_get_scale_async", None)), "GradScaler", "_get_scale_async")

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    expect(
        hasattr(opt.step, "_wrapped_by_lr_sched"),
        "torch.optim.lr_scheduler",
        "_wrapped_by_lr_sched",
    )
    opt.step()
    expect(getattr(opt, "_opt_called", False) is True, "torch.optim.Optimizer", "_opt_called")
    expect(isinstance(getattr(param, "_version", None), int), "torch.Tensor", "_version")

    expect(
        f"{CLIP_SCALE}(" in inspect.getsource(clip_grad.clip_grad_norm_),
        "torch.nn.utils.clip_grad.clip_grad_norm_",
        f"calling {CLIP_SCALE}",
    )
    from torch.distributed.tensor.parallel import ddp as ddp_tensor_parallel

    expect(
        f"t.{DDP_LOCALIZED} = " in inspect.getsource(ddp_tensor_parallel._localize_dtensor),
        "torch.distributed.tensor.parallel.ddp._localize_dtensor",
        f"setting {DDP_LOCALIZED}",
    )
    # Imported here, not at the top: it loads torch._dynamo (seconds), which only this check and
    # pipeline-parallel jobs need.
    from torch.distributed.pipelining import schedules

    expect(
        f"self.{PIPELINE_LOSS}("
        in inspect.getsource(schedules._PipelineSchedule._maybe_compute_loss),
        "torch.distributed.pipelining.schedules",
        f"_PipelineSchedule.{PIPELINE_LOSS}",
    )
    return out
