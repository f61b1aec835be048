"""The step report: what ``agent.step(loss)`` returns, identical on every rank."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .detect.verdict import Verdict

ACTIVATION_FIELDS = ("mean", "rms", "abs_max", "zero_fraction", "saturation_fraction", "nonfinite")


@dataclass
class Report:
    """One training step as every rank agreed on it after the reduction.

    Global fields are derived from the reduced vector, so they are bit-identical on every rank;
    the ``local_*`` and ``step_seconds`` fields describe this rank alone.
    """

    step: int
    """1-based count of ``agent.step`` calls."""
    loss: float
    """Mean of the ranks' losses (NaN when no rank knew its loss: the step measured gradients
    only)."""
    grad_norm: dict[str, float]
    """Block name -> L2 norm of the block's full (unsharded, synchronized) gradient."""
    grad_norm_total: float
    """L2 norm over all gradients, as ``clip_grad_norm_`` computes it (before any clipping);
    over the measured blocks when some are missing, NaN when all are."""
    update_ratio: dict[str, float] = field(default_factory=dict)
    """Block name -> ||w_new - w_old|| / ||w_old|| of the optimizer update applied at
    ``update_ratio_step``; empty on steps that carry no measurement."""
    update_ratio_step: int | None = None
    """The step whose optimizer update ``update_ratio`` describes (the previous sampled step:
    the update is only known after ``optimizer.step()``, so it rides the next reduction)."""
    activations: dict[str, dict[str, float]] = field(default_factory=dict)
    """Block name -> {mean, rms, abs_max, zero_fraction, saturation_fraction, nonfinite} of the
    block's output over this step's training forward passes, on sampled steps."""
    nonfinite: bool = False
    """A NaN/Inf in any rank's loss or gradient."""
    nonfinite_loss: bool = False
    nonfinite_grad: bool = False
    verdicts: list[Verdict] = field(default_factory=list)
    """Named failure patterns (filled by detection)."""
    action: str = "step"
    """"step" (the optimizer stepped), "skip" (no optimizer step on any rank), "rollback" (every
    rank restored the last healthy checkpoint) or "abort" (the loop guard gave up)."""
    lr: list[float] = field(default_factory=list)
    """The learning rate each param group stepped with (or would have, on a skipped step):
    the rate its scheduler, framework or loop set, times the watchdog's back-off."""
    clip_coef: float = 1.0
    """Factor the gradients were scaled by when ``clip_grad_norm`` is set (1.0 otherwise)."""
    world_size: int = 1
    mean_step_seconds: float = math.nan
    """Mean over the ranks of their ``step_seconds``."""
    rank: int = 0
    local_loss: float = math.nan
    step_seconds: float = math.nan
    """This rank's wall time since its previous ``agent.step`` returned (or since ``watch``)."""
    samples: int | None = None
    """Samples this rank processed in the step, when the caller said so."""
    compute_seconds: float = math.nan
    """This rank's time from its previous step's end to the end of its last forward pass: data
    loading and forward, before the backward's collectives make every rank wait for the slowest."""
    mean_compute_seconds: float = math.nan
    """Mean over the ranks of their ``compute_seconds`` (a straggler is judged against it)."""
    loss_scale: float | None = None
    """The GradScaler scale used this step (when ``agent.step(loss, scaler=...)``)."""
    rollback: dict[str, Any] | None = None
    """With action "rollback": {"to_step", "lr_scale", "skipped"}: the batch indices
    ``[start, stop)`` of ``agent.batches`` never trained on, or None when the loop draws its own
    batches (its RNGs were re-seeded so they are not drawn again)."""
    checkpointed: bool = False
    """A healthy checkpoint of this step was taken: saved, or staged in host memory and being
    written in the background (see ``checkpoint_committed``)."""
    checkpoint_committed: int | None = None
    """The step of a staged healthy checkpoint that every rank finished writing, committed at
    this step (the new rollback target)."""
    checkpoint_failed: str | None = None
    """Why the background write of a staged checkpoint failed (on some rank), when that became
    known at this step; the previous checkpoint stays the rollback target."""
    overflow: bool = False
    """The scaler found Inf/NaN gradients on some rank: the step was skipped, the scale backed off."""
    tokens: int | None = None
    """Tokens this rank processed in the step, when the caller said so (for tokens/s)."""
    local_data_wait_seconds: float = 0.0
    """This rank's time waiting for its batches since its previous step (``agent.batches``,
    ``agent.record_data_wait``); part of its compute time."""
    data_wait_mean_seconds: float = 0.0
    """The ranks' mean data wait of this step."""
    data_wait_ratio: float = 0.0
    """The ranks' summed data wait over their summed step time: the share of the step spent
    waiting for data (``data_stall``)."""
    memory: dict[str, float] = field(default_factory=dict)
    """Sampled steps: the largest ``resident_bytes`` (and, on CUDA, ``accelerator_allocated_bytes``)
    over the ranks: the rank nearest to running out (``memory_growth``)."""
    local_accelerator_memory: dict[str, float] | None = None
    """On CUDA: this rank's allocated, reserved, peak (since the sample before) and
    fragmentation (reserved - allocated) bytes, as read at the last sampled step."""
    replicas_checked: bool = False
    """The DDP replicas' parameter fingerprints were compared at this step (sampled steps)."""
    replica_mismatch: dict[str, list[int]] = field(default_factory=dict)
    """Block -> the ranks whose parameters differ from the others' (``replica_divergence``)."""
    grad_norm_missing: list[str] = field(default_factory=list)
    """Blocks none of whose gradients any rank could read this step (``param.grad`` None and
    no framework partition holding one): their ``grad_norm`` is NaN, unmeasured, never 0."""

    @property
    def sampled(self) -> bool:
        return bool(self.activations) or bool(self.update_ratio)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict: non-finite floats become the strings "nan", "inf", "-inf"."""
        return json_safe(asdict(self))


def json_safe(value: Any, *, strict: str | None = None, keep_nonfinite: bool = False) -> Any:
    """A copy of ``value`` that JSON can hold: tuples as lists, non-finite floats as the strings
    "nan", "inf", "-inf" (read back with ``json_number``).

    Args:
        value: numbers, strings, lists, tuples and dicts, nested.
        strict: None leaves other objects as they are (a log writes them with ``str``); else
            the name of ``value`` for the TypeError raised on a non-string key or an object JSON
            cannot hold.
        keep_nonfinite: keep NaN/Inf as floats (Python's json reads them back as floats, which
            a scheduler's ``best = inf`` needs).
    """
    if isinstance(value, float) and not math.isfinite(value) and not keep_nonfinite:
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [
            json_safe(v, strict=strict and f"{strict}[{i}]", keep_nonfinite=keep_nonfinite)
            for i, v in enumerate(value)
        ]
    if isinstance(value, dict):
        if strict and (bad := next((k for k in value if not isinstance(k, str)), None)) is not None:
            raise TypeError(f"{strict} has the non-string key {bad!r}")
        return {
            k: json_safe(v, strict=strict and f"{strict}[{k!r}]", keep_nonfinite=keep_nonfinite)
            for k, v in value.items()
        }
    if strict:
        raise TypeError(
            f"{strict} holds a {type(value).__name__}, which JSON cannot hold "
            "(numbers, strings, lists, dicts with string keys)"
        )
    return value


def json_number(x: Any) -> float:
    """A number as ``json_safe`` wrote it ("nan", "inf" included); NaN for anything else."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan
