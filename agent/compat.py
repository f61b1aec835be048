"""Every private torch and accelerate name torchvitals reads or writes, in one place, checked.

    from torchvitals.agent import compat
    compat.check()          # raises CompatError naming each missing name and the torch version

torchvitals leans on a few names torch and accelerate do not promise to keep: GradScaler's
per-optimizer state and its no-sync scale accessor, the LR schedulers' "the optimizer stepped"
markers, the private function ``clip_grad_norm_`` scales gradients through, the state-dict copy
helpers, the prefixes wrappers put in parameter names. Every other module reaches them through
this one (``tests/unit/test_layout.py`` holds them to it), so a torch upgrade that renames one
fails ``check()`` in one unit test, with the name, instead of misbehaving at run time.

At import, a torch older than ``MIN_TORCH`` (pyproject.toml's floor) raises ``CompatError``
naming the version and the supported range, and so does a name the code below binds directly (a
function, a class) that is missing: ``torchvitals.watch`` imports this module, so an unsupported
torch is refused there, before the first step, never a crash mid-run. A torch newer than the
series .ci/run tests only warns, since the names may well still hold. ``check()`` also builds
the small objects whose instance attributes are used (a GradScaler, an optimizer with a
scheduler) and raises on either.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
import torch.optim.lr_scheduler
from torch.amp import grad_scaler
from torch.distributed import _state_dict_utils
from torch.distributed.checkpoint import state_dict as _dcp_state_dict
from torch.nn.modules import batchnorm, dropout
from torch.torch_version import TorchVersion

from ..errors import TorchvitalsError

SUPPORTED_TORCH = "2.13"
"""The oldest torch release series supported."""
MIN_TORCH = "2.13.0a0"
"""``pyproject.toml``'s floor (``torch>=2.13.0a0``): the ``a0`` admits local and pre-release
builds of 2.13 such as NGC's ``2.13.0a0+git1a2b3c4``; there is no upper bound."""
TESTED_TORCH = ("2.13", "2.14")
"""The series .ci/run tests (2.13 the whole suite, 2.14 the unit tier)."""


class CompatError(TorchvitalsError, RuntimeError):
    """A private torch or accelerate name torchvitals relies on is missing or changed."""


def supported_range() -> str:
    """``"torch>=2.13.0a0 (tested: 2.13.x, 2.14.x)"``: what messages name."""
    return f"torch>={MIN_TORCH} (tested: {', '.join(s + '.x' for s in TESTED_TORCH)})"


def _missing(where: str, name: str) -> str:
    return f"{where}.{name} (torch {torch.__version__}; torchvitals supports {supported_range()})"


def _bind(owner: Any, name: str, where: str) -> Any:
    if not hasattr(owner, name):
        raise CompatError(f"torchvitals needs {_missing(where, name)}: it is gone")
    return getattr(owner, name)


def torch_series(version: str = torch.__version__) -> str:
    """``"2.13"`` of ``"2.13.0+cpu"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def too_old(version: str | None = None) -> str | None:
    """Why torchvitals refuses torch ``version`` (default: the one imported), or None when it is
    not older than ``MIN_TORCH`` (local and pre-release versions compare as PEP 440 says)."""
    version = torch.__version__ if version is None else version
    if TorchVersion(version) < MIN_TORCH:
        return (
            f"torch {version} is older than torchvitals supports: it needs "
            f"{supported_range()}; install a newer torch (pip install 'torch>={MIN_TORCH}')"
        )
    return None


if (_refused := too_old()) is not None:
    raise CompatError(_refused)
if torch_series() not in TESTED_TORCH:
    warnings.warn(
        f"torchvitals is tested on {', '.join(s + '.x' for s in TESTED_TORCH)}, this is "
        f"torch {torch.__version__}: run torchvitals.agent.compat.check()",
        stacklevel=2,
    )

# ---------------------------------------------------------------- bound at import

clip_grad = torch.nn.utils.clip_grad
"""The module whose global ``clip_grad_norm_`` calls to scale gradients (patched there)."""
CLIP_SCALE = "_clip_grads_with_norm_"
"""``clip_grad_norm_`` computes the total norm, then calls this module global to scale."""
_bind(clip_grad, CLIP_SCALE, "torch.nn.utils.clip_grad")
_bind(torch.nn.utils, "clip_grads_with_norm_", "torch.nn.utils")

foreach_norm = _bind(torch, "_foreach_norm", "torch")
foreach_mul = _bind(torch, "_foreach_mul", "torch")
foreach_mul_ = _bind(torch, "_foreach_mul_", "torch")
foreach_sub_ = _bind(torch, "_foreach_sub_", "torch")
"""torch's multi-tensor kernels: one launch for a list of tensors."""

copy_state_dict = _bind(
    _state_dict_utils, "_copy_state_dict", "torch.distributed._state_dict_utils"
)
create_cpu_state_dict = _bind(
    _state_dict_utils, "_create_cpu_state_dict", "torch.distributed._state_dict_utils"
)
"""What torch's own async checkpointing stages with (pinned host copies, one pass)."""

init_optim_state = _bind(
    _dcp_state_dict, "_init_optim_state", "torch.distributed.checkpoint.state_dict"
)
"""Gives an optimizer with no state yet its state tensors (one step at learning rate 0 with zero
gradients), so a checkpoint loads into them: what DCP's own optimizer state dict does first."""

BatchNorm = _bind(batchnorm, "_BatchNorm", "torch.nn.modules.batchnorm")
DropoutNd = _bind(dropout, "_DropoutNd", "torch.nn.modules.dropout")
"""The bases of every BatchNorm and Dropout variant."""

OptState = _bind(grad_scaler, "OptState", "torch.amp.grad_scaler")
GradScaler = grad_scaler.GradScaler

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
"""What DDP, torch.compile, FSDP1 and checkpoint_wrapper put before a wrapped module's
parameter names."""

# ---------------------------------------------------------------- instance attributes


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


def tensor_version(t: torch.Tensor) -> int:
    """Autograd's in-place modification counter of ``t``."""
    return t._version


def compiled_inner(model: Any) -> Any:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds, or None."""
    return getattr(model, "_orig_mod", None)


def wrapped_module(model: Any) -> Any:
    """The module a wrapper holds (DDP's, FSDP1's, DeepSpeed's engine's ``.module``,
    ``torch.compile``'s original), or None for a module that wraps nothing."""
    inner = getattr(model, "module", None) or compiled_inner(model)
    return inner if isinstance(inner, torch.nn.Module) else None


def accelerate_overflow(optimizer: Any) -> bool:
    """Whether accelerate's ``AcceleratedOptimizer`` marked its last step an fp16 overflow (it
    then leaves the Trainer's scheduler alone)."""
    return bool(getattr(optimizer, "_is_overflow", False))


def clear_accelerate_overflow(optimizer: Any) -> None:
    """Unmark it: the Trainer then steps its scheduler as after any real step."""
    optimizer._is_overflow = False


# ---------------------------------------------------------------- the check


PIPELINE_LOSS = "_compute_loss"
"""The method a ``torch.distributed.pipelining`` schedule computes each microbatch's loss with on
the last stage (through the loss function it was built with: torchtitan's, captured at build
time). Its metadata inference on the first step calls that loss function directly on stand-in
outputs, not through this method, so only real microbatch losses pass here."""


def problems() -> list[str]:
    """Each private name that does not hold in the installed torch (and accelerate, when it is
    installed), as a sentence naming it; empty when all hold."""
    out = [reason] if (reason := too_old()) else []

    def expect(ok: bool, where: str, name: str) -> None:
        if not ok:
            out.append(_missing(where, name))

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
    from torch.distributed.pipelining import schedules

    expect(
        f"self.{PIPELINE_LOSS}("
        in inspect.getsource(schedules._PipelineSchedule._maybe_compute_loss),
        "torch.distributed.pipelining.schedules",
        f"_PipelineSchedule.{PIPELINE_LOSS}",
    )
    from torch._dynamo.eval_frame import OptimizedModule

    expect(
        "self._orig_mod" in inspect.getsource(OptimizedModule.__init__),
        "torch._dynamo.eval_frame.OptimizedModule",
        "_orig_mod",
    )
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper
    from torch.distributed.fsdp import _common_utils

    wrapped = getattr(checkpoint_wrapper, "_CHECKPOINT_WRAPPED_MODULE", None)
    expect(
        f"{wrapped}." in WRAPPER_PREFIXES,
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "_CHECKPOINT_WRAPPED_MODULE",
    )
    wrapped = getattr(_common_utils, "FSDP_WRAPPED_MODULE", None)
    expect(
        f"{wrapped}." in WRAPPER_PREFIXES,
        "torch.distributed.fsdp._common_utils",
        "FSDP_WRAPPED_MODULE",
    )
    try:
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError:
        pass
    else:
        expect(
            "self._is_overflow" in inspect.getsource(AcceleratedOptimizer),
            "accelerate.optimizer.AcceleratedOptimizer",
            "_is_overflow",
        )
    return out + _deepspeed_problems()


# ---------------------------------------------------------------- DCP's .metadata

from torch.distributed.checkpoint import filesystem as _dcp_filesystem  # noqa: E402
from torch.distributed.checkpoint import metadata as _dcp_metadata  # noqa: E402

DCP_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): _bind(
            _dcp_metadata, name, "torch.distributed.checkpoint.metadata"
        )
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _bind(
        _dcp_filesystem, "_StorageInfo", "torch.distributed.checkpoint.filesystem"
    ),
    ("torch.serialization", "_get_layout"): _bind(
        torch.serialization, "_get_layout", "torch.serialization"
    ),
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    ("pathlib", "PosixPath"): __import__("pathlib").PosixPath,
    ("pathlib", "PurePosixPath"): __import__("pathlib").PurePosixPath,
}
"""The only globals a DCP ``.metadata`` pickle of torch 2.13 names (plus torch's dtypes, found
by name): everything the restricted unpickler in ``recover/trust.py`` lets it build."""
DCP_METADATA_FILE = ".metadata"
"""DCP's metadata file in a checkpoint folder (one writer: the coordinator)."""


# ---------------------------------------------------------------- DeepSpeed ZeRO-1/2

ZERO_PARTITIONED_GRADS = "averaged_gradients"
"""DeepSpeed ZeRO-1/2 optimizer: each param group's gradient partition of this rank, from the
end of the backward pass until its ``step`` consumes it."""


def is_zero_optimizer(obj: Any) -> bool:
    """DeepSpeed's ZeRO stage 1/2 optimizer (it keeps the gradients in its own partitions)."""
    return (
        type(obj).__module__ == "deepspeed.runtime.zero.stage_1_and_2"
        and hasattr(obj, ZERO_PARTITIONED_GRADS)
        and hasattr(obj, "bit16_groups")
    )


def zero_loss_scaled(optimizer: Any) -> bool:
    """DeepSpeed's ZeRO-1/2 optimizer trains in fp16: its partitions hold loss-scaled gradients."""
    return getattr(optimizer, "dtype", None) == torch.float16


def zero_model_params(optimizer: Any) -> list[list[torch.Tensor]]:
    """The model parameters DeepSpeed's ZeRO-1/2 optimizer steps, per param group (its torch
    optimizer holds flat partitions instead)."""
    return [list(group) for group in optimizer.bit16_groups]


ZERO_MASTER_PARTITIONS = "single_partition_of_fp32_groups"
"""DeepSpeed ZeRO-1/2 optimizer: this rank's fp32 master partition of each param group, the
flat tensor its torch optimizer steps (and holds the state of)."""


def zero_partitions(optimizer: Any) -> list[torch.Tensor]:
    """This rank's fp32 master partition of each param group of DeepSpeed's ZeRO-1/2 optimizer,
    in the order of its torch optimizer's param groups."""
    return list(getattr(optimizer, ZERO_MASTER_PARTITIONS))


def zero_partition_rank(optimizer: Any) -> tuple[int, int]:
    """``(this rank's partition, how many)`` of DeepSpeed's ZeRO-1/2 optimizer (its data-parallel
    group's rank and size)."""
    group = optimizer.dp_process_group
    return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)


def zero_grad_fragment(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's fragment of ``param``'s gradient under DeepSpeed ZeRO-1/2, or None when this
    rank holds none of it (the fragments of the ranks are disjoint and cover the gradient) or
    when the optimizer holds no gradient now (before a backward pass, after its step)."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    try:
        return mapping.get_lp_grad_fragment(param._index_in_param_group)
    except ValueError:  # "Gradients are only available ... before engine step"
        return None


# ---------------------------------------------------------------- torchtitan's CheckpointManager

TITAN_FIND_LOAD_STEP = "_find_load_step"
TITAN_CHECKPOINT_ID = "_create_checkpoint_id"
"""torchtitan 0.3.0's ``CheckpointManager``: the newest ``step-N`` of its folder that holds a
checkpoint (-1: none), and the folder of step N (read only by ``titan_checkpoint_to_load``)."""


def titan_checkpoint_to_load(checkpointer: Any, step: int = -1) -> tuple[int, str | None]:
    """``(step, folder)`` that torchtitan's ``checkpointer.load(step)`` would read from its own
    folder; ``(-1, None)`` when that folder holds none (torchtitan then starts afresh, or from
    its ``initial_load_path``)."""
    for name in (TITAN_FIND_LOAD_STEP, TITAN_CHECKPOINT_ID):
        if not callable(getattr(checkpointer, name, None)):
            raise CompatError(
                f"torchvitals needs torchtitan's CheckpointManager.{name} "
                "(torchtitan 0.3.0): it is gone"
            )
    target = getattr(checkpointer, TITAN_FIND_LOAD_STEP)() if step == -1 else step
    if target < 0:
        return -1, None
    return target, str(getattr(checkpointer, TITAN_CHECKPOINT_ID)(target))


# ---------------------------------------------------------------- DeepSpeed ZeRO-3

ZERO3_MODULE = "deepspeed.runtime.zero.stage3"
"""Where DeepSpeed's ZeRO-3 optimizer, ``DeepSpeedZeroOptimizer_Stage3``, lives."""
ZERO3_GRADS = "averaged_gradients"
"""DeepSpeed ZeRO-3 optimizer: per sub-group, the list of this rank's gradient partitions of the
sub-group's parameters (``fp16_groups[i]``, in order), set after each backward pass and emptied
by its step. Its own norm (``get_global_grad_norm()``) is computed from exactly these lists."""
ZERO3_GROUPS = "fp16_groups"
"""DeepSpeed ZeRO-3 optimizer: the model parameters it steps, per sub-group."""


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


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter: a ZeRO-3 parameter's ``ds_numel`` (its ``numel()`` is
    0 while partitioned), any other's ``numel()`` (a DTensor's is its global one)."""
    numel = getattr(param, "ds_numel", None)
    return int(numel) if numel is not None else param.numel()


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
            import torch.distributed as dist

            size = param.ds_tensor.ds_numel
            start = size * dist.get_rank(group=param.ds_process_group)
            n = self._valid[id(param)] = max(0, min(size, param.ds_numel - start))
        return n

    def param(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's values of ``param`` (a view of its partition; possibly empty)."""
        return param.ds_tensor.detach().narrow(0, 0, self._length(param))

    def grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of ``param``'s gradient, or None when the optimizer holds none now
        (before a backward pass, after its step, or with its optimizer offloaded to the CPU:
        the partitions then live in the offloaded fp32 buffers instead)."""
        where = self._where.get(id(param))
        if where is None:
            return None
        grads = getattr(self._optimizer, ZERO3_GRADS).get(where[0])
        return None if grads is None else grads[where[1]].narrow(0, 0, self._length(param))


ZERO3_MASTERS = "fp32_partitioned_groups_flat"
"""DeepSpeed ZeRO-3 optimizer: this rank's fp32 master partition of each sub-group, the flat
tensor its torch optimizer steps and keys its state by (with fp32 training, the very buffer the
parameters' partitions are views of)."""
ZERO3_SUB_GROUP_TO_GROUP = "sub_group_to_group_id"
"""DeepSpeed ZeRO-3 optimizer: the torch optimizer's param group each sub-group steps in (its
torch optimizer's ``params`` lists are empty outside its step)."""


def zero3_masters(optimizer: Any) -> list[torch.Tensor]:
    """This rank's fp32 master partition of each sub-group of DeepSpeed's ZeRO-3 optimizer."""
    return list(getattr(optimizer, ZERO3_MASTERS))


def zero3_group_of(optimizer: Any) -> list[int]:
    """The torch param group each sub-group of DeepSpeed's ZeRO-3 optimizer steps in."""
    owner = getattr(optimizer, ZERO3_SUB_GROUP_TO_GROUP)
    return [owner[i] for i in range(len(zero3_masters(optimizer)))]


def zero3_partition(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's whole partition of a ZeRO-3 parameter (``ds_tensor``, padding included:
    what DeepSpeed gathers from), or None for a parameter DeepSpeed does not partition."""
    return getattr(param, "ds_tensor", None)


def zero3_unsupported_checkpoint(optimizer: Any) -> str | None:
    """Why this rank's ZeRO-3 state is not checkpointed in place, or None: offloaded, the
    optimizer's partitions (and with NVMe, its state) live in DeepSpeed's offload buffers, a
    layout torchvitals' restore does not cover."""
    if any(
        getattr(optimizer, name, False)
        for name in ("offload_optimizer", "swap_optimizer", "offload_param")
    ):
        return "its optimizer state or parameters are offloaded (offload_optimizer/offload_param)"
    return None


def zero3_release_all(optimizer: Any) -> None:
    """Partition every parameter again (the whole copies a forward gathered, prefetched ones
    and the persistent small parameters dropped): what DeepSpeed does before loading its own
    checkpoint, so nothing gathered from the old partitions survives a restore."""
    optimizer.checkpoint_event_prologue()


def zero3_regather(optimizer: Any) -> None:
    """Drop the secondary (hpZ) partition copies and gather the persistent parameters again
    from the partitions: what DeepSpeed does after loading its own checkpoint."""
    optimizer.checkpoint_event_epilogue()


def _deepspeed_problems() -> list[str]:
    """The DeepSpeed names above that do not hold in the installed DeepSpeed (none installed:
    nothing to check)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return []
    import importlib

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
    partitioning = importlib.import_module("deepspeed.runtime.zero.partition_parameters")
    parts = inspect.getsource(partitioning)
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


def check() -> None:
    """Raise ``CompatError`` when this torch is older than ``MIN_TORCH`` or any private name
    does not hold (see ``problems``); the message names the torch version and the supported
    range. A newer torch whose names all hold passes (its import warned that it is untested).

    Costs about a second (it builds small objects and reads torch's, accelerate's and
    DeepSpeed's source): run it once, in a test or before a long job, not per step.
    """
    found = problems()
    if found:
        raise CompatError(
            f"torchvitals cannot run on torch {torch.__version__} (it supports "
            f"{supported_range()}):\n  " + "\n  ".join(found)
        )
