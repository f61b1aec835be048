"""The step report: what ``agent.step(loss)`` returns, identical on every rank.

    report = agent.step(loss)
    report.action == Action.ROLLBACK          # an Action, also equal to the string "rollback"
    report.rollback.to_step                   # a Rollback, None unless the step rolled back
    report.timing.mean_step_seconds           # the groups: timing, checkpoint, replicas, local

The fields users read most are top-level; the rest live in small records by what they describe.
``to_dict`` writes every field flat (the event log's line, read back by ``from_dict``,
``torchvitals report`` and ``diagnose``), each record field under its ``FLAT_NAMES`` key
(``checkpointed`` for ``report.checkpoint.saved``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from ..records.vocabulary import REMEDIES, RERUN, Action
from .detect.verdict import Verdict
from .jsonsafe import json_number, json_safe

__all__ = [
    "Action",
    "Checkpointing",
    "RankLocal",
    "ReplicaCheck",
    "Report",
    "Rerun",
    "Rollback",
    "StepTiming",
]

ACTIVATION_FIELDS = ("mean", "rms", "abs_max", "zero_fraction", "saturation_fraction", "nonfinite")


@dataclass(frozen=True, kw_only=True)
class Rollback:
    """One rollback, as every rank took it (``to_dict()`` for its JSON form)."""

    to_step: int
    """The healthy step restored."""
    lr_scale: float
    """The learning-rate scale from now on (the cumulative back-off)."""
    skipped: tuple[int, int] | None = None
    """Batch indices ``[start, stop)`` of ``agent.batches`` never trained on; None: the loop
    draws its own batches, and its RNGs were re-seeded so they are not drawn again."""
    repeat_of: int | None = None
    """The step of the earlier rollback that did not cure the run (its checkpoint is now
    distrusted and this one went further back); None: a first rollback."""
    escalation: int = 0
    """Rollbacks in a row that did not cure before this one: the learning rate was cut this
    many extra times, the skip margin doubled as often."""

    def to_dict(self) -> dict[str, Any]:
        """``{"to_step", "lr_scale", "skipped", "repeat_of", "escalation"}`` (``skipped`` a list
        or None), as JSON holds it."""
        skipped = list(self.skipped) if self.skipped is not None else None
        return {
            "to_step": self.to_step,
            "lr_scale": self.lr_scale,
            "skipped": skipped,
            "repeat_of": self.repeat_of,
            "escalation": self.escalation,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rollback:
        skipped = d.get("skipped")
        repeat_of = d.get("repeat_of")
        return cls(
            to_step=int(d["to_step"]),
            lr_scale=json_number(d["lr_scale"]),
            skipped=(int(skipped[0]), int(skipped[1])) if skipped else None,
            repeat_of=None if repeat_of is None else int(repeat_of),
            escalation=int(d.get("escalation", 0)),
        )


@dataclass(frozen=True, kw_only=True)
class Rerun:
    """A suspect step computed once more on every rank (``agent.step(loss, closure=fn)``)."""

    loss: float
    """The recomputed loss: the mean over the ranks, as the step's own."""
    reproduced: bool
    """Whether the recomputed loss was still past the threshold that judged the step (a bad
    batch reproduces; a transient fault does not)."""
    ranks: list[int] = field(default_factory=list)
    """The ranks whose own loss was past the culprit cut at first and is not now, exactly when
    one or two were (``rank_count`` says how many)."""
    rank_count: int = 0
    seconds: float = math.nan
    """How long the re-run took on this rank (forward, backward and its reduction)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss,
            "reproduced": self.reproduced,
            "ranks": list(self.ranks),
            "rank_count": self.rank_count,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rerun:
        return cls(
            loss=json_number(d["loss"]),
            reproduced=bool(d["reproduced"]),
            ranks=[int(r) for r in d.get("ranks", [])],
            rank_count=int(d.get("rank_count", 0)),
            seconds=json_number(d.get("seconds", math.nan)),
        )


@dataclass
class StepTiming:
    """How long the step took: this rank's seconds, and the means over the ranks."""

    step_seconds: float = math.nan
    """This rank's wall time since its previous ``agent.step`` returned (or since ``watch``)."""
    compute_seconds: float = math.nan
    """This rank's time from its previous step's end to the end of its last forward pass: data
    loading and forward, before the backward's collectives make every rank wait for the slowest."""
    mean_step_seconds: float = math.nan
    """Mean over the ranks of their ``step_seconds``."""
    mean_compute_seconds: float = math.nan
    """Mean over the ranks of their ``compute_seconds`` (a straggler is judged against it)."""
    data_wait_seconds: float = 0.0
    """This rank's time waiting for its batches since its previous step (``agent.batches``,
    ``agent.record_data_wait``); part of its compute time."""
    data_wait_mean_seconds: float = 0.0
    """The ranks' mean data wait of this step."""
    data_wait_ratio: float = 0.0
    """The ranks' summed data wait over their summed step time: the share of the step spent
    waiting for data (``data_stall``)."""


@dataclass
class Checkpointing:
    """The healthy checkpoints this step took, committed or lost."""

    saved: bool = False
    """A healthy checkpoint of this step was taken: saved, or staged in host memory and being
    written in the background (see ``committed``)."""
    committed: int | None = None
    """The step of a staged healthy checkpoint that every rank finished writing, committed at
    this step (the new rollback target)."""
    failed: str | None = None
    """Why the background write of a staged checkpoint failed (on some rank), when that became
    known at this step; the previous checkpoint stays the rollback target."""


@dataclass
class ReplicaCheck:
    """The DDP replicas' parameter fingerprints (sampled steps)."""

    checked: bool = False
    """The fingerprints were compared at this step."""
    mismatch: dict[str, list[int]] = field(default_factory=dict)
    """Block -> the ranks whose parameters differ from the others' (``replica_divergence``)."""


@dataclass
class RankLocal:
    """What this rank alone saw (every other field is the same on every rank)."""

    loss: float = math.nan
    """This rank's loss (NaN when it did not know one)."""
    samples: int | None = None
    """Samples this rank processed in the step, when the caller said so."""
    tokens: int | None = None
    """Tokens this rank processed in the step, when the caller said so (for tokens/s)."""
    accelerator_memory: dict[str, float] | None = None
    """On CUDA: this rank's allocated, reserved, peak (since the sample before) and
    fragmentation (reserved - allocated) bytes, as read at the last sampled step."""


RECORDS: dict[str, type] = {
    "timing": StepTiming,
    "checkpoint": Checkpointing,
    "replicas": ReplicaCheck,
    "local": RankLocal,
}
"""The report's records, by field name."""

FLAT_NAMES: dict[str, tuple[str, str]] = {
    "step_seconds": ("timing", "step_seconds"),
    "compute_seconds": ("timing", "compute_seconds"),
    "mean_step_seconds": ("timing", "mean_step_seconds"),
    "mean_compute_seconds": ("timing", "mean_compute_seconds"),
    "local_data_wait_seconds": ("timing", "data_wait_seconds"),
    "data_wait_mean_seconds": ("timing", "data_wait_mean_seconds"),
    "data_wait_ratio": ("timing", "data_wait_ratio"),
    "checkpointed": ("checkpoint", "saved"),
    "checkpoint_committed": ("checkpoint", "committed"),
    "checkpoint_failed": ("checkpoint", "failed"),
    "replicas_checked": ("replicas", "checked"),
    "replica_mismatch": ("replicas", "mismatch"),
    "local_loss": ("local", "loss"),
    "samples": ("local", "samples"),
    "tokens": ("local", "tokens"),
    "local_accelerator_memory": ("local", "accelerator_memory"),
}
"""The flat name of each record field: its key in ``to_dict``'s line (the event log's), which
``from_dict`` reads back into the record (``checkpointed`` is ``report.checkpoint.saved``)."""


@dataclass(kw_only=True)
class Report:
    """One training step as every rank agreed on it after the reduction.

    Every field is derived from the reduced vector, so it is bit-identical on every rank, but
    ``rank``, ``local`` and ``timing``'s ``step_seconds``, ``compute_seconds`` and
    ``data_wait_seconds``, which describe this rank alone. A field nobody measured keeps its
    default, which means "unknown" (NaN, None, empty).
    """

    step: int
    """1-based count of ``agent.step`` calls."""
    loss: float = math.nan
    """Mean of the ranks' losses (NaN when no rank knew its loss: the step measured gradients
    only)."""
    grad_norm: dict[str, float] = field(default_factory=dict)
    """Block name -> L2 norm of the block's full (unsharded, synchronized) gradient."""
    grad_norm_total: float = math.nan
    """L2 norm over all gradients, as ``clip_grad_norm_`` computes it (before any clipping);
    over the measured blocks when some are missing, NaN when all are."""
    grad_norm_missing: list[str] = field(default_factory=list)
    """Blocks none of whose gradients any rank could read this step (``param.grad`` None and
    no framework partition holding one): their ``grad_norm`` is NaN, unmeasured, never 0."""
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
    nonfinite_ranks: list[int] = field(default_factory=list)
    """The ranks whose own loss was NaN/Inf at this step (ranks of the agent's process group:
    the global ranks unless ``watch(group=)`` names another), exactly when one or two were;
    empty when none was, or three and more (``nonfinite_rank_count`` says how many). A
    non-finite gradient names no rank: the gradients are reduced over the ranks (under DDP or
    FSDP one rank's NaN reaches every rank in the backward pass), its blocks are in
    ``grad_norm``."""
    nonfinite_rank_count: int = 0
    """How many ranks' own loss was NaN/Inf at this step."""
    spike_ranks: list[int] = field(default_factory=list)
    """The ranks whose own loss alone could have lifted the mean past the loss rule's threshold
    (a loss at least ``world`` times as far above the median as the threshold lies), exactly
    when one or two were; the culprit of a ``loss_outlier`` or ``loss_spike`` that one rank's
    forward caused. Empty when none was (a spike every rank shares) or three and more."""
    spike_rank_count: int = 0
    """How many ranks' own loss was that far out."""
    activation_ranks: list[int] = field(default_factory=list)
    """Sampled steps: the ranks whose own activations were far out (a block's output RMS on
    that rank at least ``activation_culprit_factor`` times the block's RMS over every rank at
    the last sample none was), exactly when one or two were: the culprit of a spike whose loss
    names no rank (a ``grad_spike``, whose loss did not move; a pipeline's early stages). Empty
    on other steps, when none was, three and more, or where ranks share activations (tensor
    parallelism)."""
    activation_rank_count: int = 0
    """How many ranks' own activations were that far out."""
    loop_skip_ranks: list[int] = field(default_factory=list)
    """The ranks whose loop or framework skipped this step's ``optimizer.step()`` by itself and
    cleared the gradients (one or two named exactly; ``loop_skip_count`` says how many): every
    rank skipped it with them, so the replicas stay alike."""
    loop_skip_count: int = 0
    """How many ranks' loop or framework skipped this step by itself."""
    verdicts: list[Verdict] = field(default_factory=list)
    """Named failure patterns (filled by detection)."""
    action: Action = Action.STEP
    """What every rank did with the step (an ``Action``, equal to its string value)."""
    rollback: Rollback | None = None
    """With ``Action.ROLLBACK``: where every rank went back to, and what it skipped."""
    rerun: Rerun | None = None
    """A suspect step computed once more on every rank (``agent.step(loss, closure=fn)``):
    whether it reproduced; None when it was not re-run."""
    lr: list[float] = field(default_factory=list)
    """The learning rate each param group stepped with (or would have, on a skipped step):
    the rate its scheduler, framework or loop set, times the watchdog's back-off."""
    clip_coef: float = 1.0
    """Factor the gradients were scaled by when ``clip_grad_norm`` is set (1.0 otherwise)."""
    loss_scale: float | None = None
    """The GradScaler scale used this step (when ``agent.step(loss, scaler=...)``)."""
    overflow: bool = False
    """The scaler found Inf/NaN gradients on some rank: the step was skipped, the scale backed
    off."""
    memory: dict[str, float] = field(default_factory=dict)
    """Sampled steps: the largest ``resident_bytes`` (and, on CUDA,
    ``accelerator_allocated_bytes``) over the ranks: the rank nearest to running out
    (``memory_growth``)."""
    custom: dict[str, float] = field(default_factory=dict)
    """Name -> value of the user's own signals (``watch(signals=...)``), exported with the rest."""
    world_size: int = 1
    rank: int = 0
    timing: StepTiming = field(default_factory=StepTiming)
    checkpoint: Checkpointing = field(default_factory=Checkpointing)
    replicas: ReplicaCheck = field(default_factory=ReplicaCheck)
    local: RankLocal = field(default_factory=RankLocal)

    @property
    def sampled(self) -> bool:
        return bool(self.activations) or bool(self.update_ratio)

    @property
    def remedy(self) -> str:
        """The remedy the step took: ``none``, ``skip_update`` (the update dropped on every
        rank, the batch used), ``rerun`` (computed again, the fault did not reproduce: a
        transient one, its update dropped), ``rollback`` or ``abort``
        (``vocabulary.REMEDIES``)."""
        if self.rerun is not None and not self.rerun.reproduced and self.action == Action.SKIP:
            return RERUN
        return REMEDIES[Action(self.action)]

    def to_dict(self) -> dict[str, Any]:
        """Every field as one flat JSON-safe dict (the records' fields under their
        ``FLAT_NAMES``): non-finite floats become the strings "nan", "inf", "-inf"."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name not in RECORDS:
                out[f.name] = getattr(self, f.name)
        out["action"] = str(self.action)
        out["remedy"] = self.remedy
        out["verdicts"] = [v.to_dict() if isinstance(v, Verdict) else v for v in self.verdicts]
        out["rollback"] = self.rollback.to_dict() if self.rollback is not None else None
        out["rerun"] = self.rerun.to_dict() if self.rerun is not None else None
        for flat, (record, attr) in FLAT_NAMES.items():
            out[flat] = getattr(getattr(self, record), attr)
        return json_safe(out)

    @classmethod
    def from_flat(cls, **values: Any) -> Report:
        """A report from flat names, the records' fields under their ``FLAT_NAMES`` as
        ``to_dict`` writes them: ``Report.from_flat(step=3, local_loss=0.9, checkpointed=True)``.
        """
        parts: dict[str, dict[str, Any]] = {name: {} for name in RECORDS}
        for flat, (record, attr) in FLAT_NAMES.items():
            if flat in values:
                parts[record][attr] = values.pop(flat)
        return cls(**values, **{name: RECORDS[name](**kw) for name, kw in parts.items()})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        """The report ``to_dict`` wrote (an event log's ``"event": "step"`` line, say); keys it
        does not know are ignored, missing ones keep their defaults."""
        known = ({f.name for f in fields(cls)} - RECORDS.keys()) | FLAT_NAMES.keys()
        values = {k: v for k, v in d.items() if k in known}
        for name in _FLOATS:
            if values.get(name) is not None:
                values[name] = json_number(values[name])
        for name in ("grad_norm", "update_ratio", "memory", "custom", "local_accelerator_memory"):
            if values.get(name) is not None:
                values[name] = _numbers(values[name])
        values["activations"] = {b: _numbers(x) for b, x in d.get("activations", {}).items()}
        values["lr"] = [json_number(x) for x in d.get("lr", [])]
        values["action"] = Action(d.get("action", Action.STEP))
        values["verdicts"] = [Verdict(**v) for v in d.get("verdicts", [])]
        values["rollback"] = Rollback.from_dict(d["rollback"]) if d.get("rollback") else None
        values["rerun"] = Rerun.from_dict(d["rerun"]) if d.get("rerun") else None
        return cls.from_flat(**values)


_FLOATS = (
    "loss",
    "grad_norm_total",
    "clip_coef",
    "loss_scale",
    "local_loss",
    *(flat for flat, (record, _) in FLAT_NAMES.items() if record == "timing"),
)
"""The float fields ``json_safe`` may have written as "nan", "inf" or "-inf"."""


def _numbers(d: dict[str, Any]) -> dict[str, float]:
    return {k: json_number(v) for k, v in d.items()}
