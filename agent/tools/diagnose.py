"""Diagnosis: one named cause, its evidence and a targeted fix, from a run's verdicts and losses.

    python -m torchvitals diagnose torchvitals_runs/<run>/events.jsonl [--job-dir ckpt]

A decision tree fed with the detector's verdicts instead of raw traces (the tree and its
reasoning: docs/patterns.md). Several root causes share a symptom, so the tree orders the
symptom classes by what happened first and names where it started. When the run's incident
records (in its job folder: ``jobrecords.py``) or its verdicts' evidence name a culprit, the
diagnosis leads with it (``culprit.py``): ``rank 1 (node 0, host h): non-finite loss at step
41``. The causes:

- optimization failures: "numerical instability", "gradient explosion", "vanishing gradients",
  "dead pipeline";
- not optimization failures: "generalization gap" (the descent succeeds at the wrong
  objective), "dead layer" (one block does not move), "straggler" (one rank is slow),
  "replica divergence" (one DDP replica's weights changed), "memory leak", "data stall";
- "no anomaly".

What the job did about it (``RESPONSES``: it gave up rolling back, or obeyed the
collector) is no cause of its own: the diagnosis lists it beside the cause.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from ...records.incidents import Incident
from ..detect import verdict as P
from ..detect.verdict import Verdict
from ..jsonsafe import json_number
from ..outputs.eventlog import read_events
from .culprit import from_incidents, from_verdicts
from .jobrecords import job_folders, read_incidents

NUMERICAL, EXPLOSION, VANISHING = (
    "numerical instability",
    "gradient explosion",
    "vanishing gradients",
)
DEAD_PIPELINE, GAP, DEAD_LAYER = "dead pipeline", "generalization gap", "dead layer"
STRAGGLER, NO_ANOMALY = "straggler", "no anomaly"
REPLICAS, LEAK, DATA = "replica divergence", "memory leak", "data stall"
UNSTEADY = "unsteady loss"
CAUSES = (
    NUMERICAL,
    EXPLOSION,
    VANISHING,
    DEAD_PIPELINE,
    GAP,
    UNSTEADY,
    DEAD_LAYER,
    STRAGGLER,
    REPLICAS,
    LEAK,
    DATA,
    NO_ANOMALY,
)

CLASSES = {
    NUMERICAL: (P.NONFINITE_LOSS, P.NONFINITE_GRAD, P.FP16_OVERFLOW),
    # hot_lr leads: the update ratio drifts up before the gradient norm and the loss follow.
    EXPLOSION: (
        P.HOT_LR,
        P.LAYER_DIVERGENCE,
        P.GRAD_EXPLOSION,
        P.LOSS_SPIKE,
        P.ACTIVATION_EXPLOSION,
    ),
    VANISHING: (P.VANISHING_GRADIENTS, P.SATURATION, P.ATTENTION_SATURATION, P.DEAD_RELU),
    DEAD_PIPELINE: (P.DEAD_PIPELINE,),
    GAP: (P.GENERALIZATION_GAP,),
    # Warnings short of a spike: one step far out (a bad batch the next one healed), the
    # gradient norm jumping while the loss stays, the loss climbing too slowly for the spike
    # rule. A cause only when nothing graver was seen: an outlier healed long before a NaN did
    # not feed it.
    UNSTEADY: (P.LOSS_DIVERGENCE, P.LOSS_OUTLIER, P.GRAD_SPIKE),
    DEAD_LAYER: (P.DEAD_LAYER,),
    STRAGGLER: (P.STRAGGLER,),
    # Silent data corruption either way: weights that differ, or a loss that did not reproduce.
    REPLICAS: (P.REPLICA_DIVERGENCE, P.TRANSIENT_FAULT),
    LEAK: (P.MEMORY_GROWTH,),
    DATA: (P.DATA_STALL,),
}
"""Cause -> the verdict patterns that are its symptoms."""

SHOWN = {
    P.NONFINITE_LOSS: ("loss",),
    P.NONFINITE_GRAD: ("blocks", "grad_norm_total"),
    P.LOSS_SPIKE: ("loss", "median", "threshold"),
    P.LOSS_OUTLIER: ("loss", "median", "threshold"),
    P.GRAD_SPIKE: ("grad_norm_total", "median", "loss"),
    P.LOSS_DIVERGENCE: ("median", "lowest_median", "steps"),
    P.GRAD_EXPLOSION: ("grad_norm_total", "median"),
    P.LAYER_DIVERGENCE: ("ratio_to_median", "grad_norm"),
    P.HOT_LR: ("update_ratio", "healthy"),
    P.DEAD_LAYER: ("update_ratio", "others_median", "requires_grad_false", "not_in_optimizer"),
    P.VANISHING_GRADIENTS: ("ratio", "first", "last"),
    P.SATURATION: ("saturation_fraction",),
    P.DEAD_RELU: ("zero_fraction",),
    P.ACTIVATION_EXPLOSION: ("abs_max", "first_abs_max"),
    P.DEAD_PIPELINE: ("max_grad_norm", "detached"),
    P.GENERALIZATION_GAP: ("validation", "best_validation"),
    P.STRAGGLER: ("rank", "seconds", "others_mean", "cause"),
    P.REPLICA_DIVERGENCE: ("blocks", "ranks"),
    P.TRANSIENT_FAULT: ("loss", "rerun_loss", "ranks"),
    P.MEMORY_GROWTH: ("memory", "rise_bytes", "bytes_per_step"),
    P.DATA_STALL: ("data_wait_ratio", "data_wait_seconds"),
}
"""Pattern -> the evidence values worth a reader's attention (others: the first few numbers)."""

RESPONSES = {
    P.ROLLBACK_LOOP: "gave up ({why}): exit code {exit_code}",
    P.COLLECTOR_DIRECTIVE: "obeyed the collector's order to {action}",
}
"""The verdicts that record the job's response (``verdict.RESPONSE_PATTERNS``), not a symptom:
each -> the line the diagnosis gives it, filled from its evidence."""

FIXES = {
    NUMERICAL: "Find the overflowing op: compute the loss from logits (log_softmax/cross_entropy, "
    "never log of a softmax), add eps to divisions and logs, prefer bf16 to fp16 (or "
    "keep a GradScaler), and clip gradients (watch(..., clip_grad_norm=1.0)) with warmup.",
    EXPLOSION: "Clip gradients (watch(..., clip_grad_norm=1.0)), lower the learning rate or "
    "lengthen warmup, and check the init scale of {block}; if a spike ruined the run, restart from "
    "the last healthy checkpoint with a lower LR and skip the offending batch.",
    VANISHING: "Fix the initialization scale (Xavier/Kaiming for the nonlinearity; the symptoms "
    "start in {block}), add normalization or residual connections, or replace saturating "
    "tanh/sigmoid units (GELU/LeakyReLU also cure dead ReLUs); clipping would only hide it.",
    DEAD_PIPELINE: "Check the wiring before tuning: a loss built from detached tensors, frozen "
    "parameters or ones missing from the optimizer, mis-loaded inputs/labels, or a "
    "loss that ignores the output; `python -m torchvitals preflight` checks these.",
    GAP: "Not an optimization failure: stop early at the best validation step, get more data or "
    "augmentation, add regularization (weight decay, dropout) or use a smaller model.",
    DEAD_LAYER: "Unfreeze {block} (requires_grad=True), check its parameters are in the "
    "optimizer with a non-zero learning rate, or reinitialize it.",
    STRAGGLER: "Look at the slow rank's host: input pipeline, CPU contention, thermal throttling "
    "or a degraded link; every other rank waits for it at each collective.",
    REPLICAS: "Suspect the named rank's hardware (ECC and row-remapper counters, DCGM diagnostics) "
    "or code that writes to one replica's weights; the watchdog rolled back to identical "
    "replicas, and a rank named again should be cordoned.",
    LEAK: "Find what keeps a reference every step (outputs or losses kept without "
    ".detach()/.item(), a growing cache); torch.cuda.memory_snapshot() or tracemalloc names "
    "the allocation site.",
    DATA: "Speed up the input pipeline: more DataLoader workers and prefetching, pinned memory, "
    "faster storage or pre-decoded data; the accelerators idle while they wait.",
    UNSTEADY: "A slow divergence: lower the peak learning rate or decay it sooner, and check "
    "what changed in the data at its first step. One-step outliers and gradient-norm spikes "
    "that heal by themselves are usually hard or corrupt batches: look them up by step in the "
    "data order; clip gradients (watch(..., clip_grad_norm=1.0)) if they recur.",
    NO_ANOMALY: "Nothing to fix in the optimization signals; if results are poor, look at data "
    "quality, labels and model capacity.",
}


HOT_LR_FIX = (
    "Lower the learning rate or lengthen warmup: the update ratio ran hot in {block} "
    "before the gradients and the loss followed; clip gradients (watch(..., "
    "clip_grad_norm=1.0)); if a spike ruined the run, restart from the last healthy "
    "checkpoint with a lower LR and skip the offending batch. Suspect the init scale of "
    "{block} only if the spike returns at a lower learning rate."
)
"""The explosion's fix when the update ratio moved first: the learning rate, not the init."""


@dataclass
class Diagnosis:
    """The most likely root cause of a run's trouble and what to do about it."""

    cause: str
    """One of CAUSES."""
    summary: str
    """One sentence naming the cause, where and when it started."""
    evidence: list[str] = field(default_factory=list)
    """Short lines citing the verdicts (step, pattern, block, values), earliest first."""
    fix: str = ""
    """The targeted fix for this cause."""
    first_step: int | None = None
    """The step of the cause's earliest symptom."""
    block: str | None = None
    """The block where the cause's earliest symptom appeared, when one was named."""
    also: list[str] = field(default_factory=list)
    """Other causes seen in the run, each with its first step."""
    culprit: str | None = None
    """Who caused it, where and when (``rank 1 (node 0, host h): non-finite loss at step
    41``), from an incident record or a verdict's evidence; None when nothing names one."""
    culprit_cause: str = ""
    """The leading incident's own one-line cause ("" without one)."""
    incidents: list[str] = field(default_factory=list)
    """One line per incident of the run, oldest first, and per record that could not be read."""
    responses: list[str] = field(default_factory=list)
    """What the job did about it (``RESPONSES``), one line each with its step, oldest first."""

    def render(self) -> str:
        """The diagnosis as a few readable lines for a terminal, the culprit first."""
        where = ", ".join(
            x
            for x in (
                f"from step {self.first_step}" if self.first_step else "",
                f"block {self.block}" if self.block else "",
            )
            if x
        )
        lines = [f"culprit: {self.culprit}"] if self.culprit else []
        lines += [f"  {self.culprit_cause}"] if self.culprit and self.culprit_cause else []
        lines += [f"cause: {self.cause}" + (f" ({where})" if where else ""), f"  {self.summary}"]
        if self.evidence:
            lines += ["evidence:"] + [f"  - {e}" for e in self.evidence]
        lines.append(f"fix: {self.fix}")
        if self.also:
            lines.append("also seen: " + "; ".join(self.also))
        if self.responses:
            lines += ["the job's response:"] + [f"  - {r}" for r in self.responses]
        if self.incidents:
            lines += ["incidents:"] + [f"  - {i}" for i in self.incidents]
        return "\n".join(lines)


def diagnose(
    verdicts: Iterable[Verdict | Mapping[str, Any]],
    losses: Iterable[tuple[int, float]],
    validation: Iterable[tuple[int, float]] = (),
    incidents: Sequence[Incident] = (),
) -> Diagnosis:
    """Walk the decision tree over a run's verdicts, backed by its loss curves, and lead with
    the culprit.

    Args:
        verdicts: ``Verdict`` objects or their dicts (pattern, severity, step, block, evidence).
        losses: (step, training loss) pairs; a NaN/Inf loss counts as a crash even without a
            verdict.
        validation: (step, validation loss) pairs; a validation loss rising while the training
            loss falls counts as a generalization gap even without a verdict.
        incidents: the run's incident records, oldest first (they name the culprit first;
            without them, a verdict's evidence may).

    Returns:
        The Diagnosis.
    """
    found = [d for d in map(_as_dict, verdicts) if d is not None]
    diagnosis = _tree(found, losses, validation)
    lead = from_incidents(incidents, diagnosis.cause, found) or from_verdicts(
        found, diagnosis.cause
    )
    if lead is not None:
        diagnosis.culprit, diagnosis.culprit_cause = lead.line, lead.cause
    diagnosis.incidents = [i.line() for i in incidents]
    diagnosis.responses = _responses(found)
    return diagnosis


def _tree(
    found: list[dict[str, Any]],
    losses: Iterable[tuple[int, float]],
    validation: Iterable[tuple[int, float]],
) -> Diagnosis:
    """The decision tree over the verdicts (as dicts) and the curves."""
    losses = sorted((int(s), json_number(x)) for s, x in losses)
    found += _from_curves(found, losses, [(int(s), json_number(x)) for s, x in validation])
    first = {c: _earliest(found, pats) for c, pats in CLASSES.items()}
    seen = {c: v for c, v in first.items() if v is not None}
    if not seen:
        return Diagnosis(
            NO_ANOMALY,
            "No failure pattern was detected in the loss, gradient, update or activation signals.",
            [],
            FIXES[NO_ANOMALY],
        )
    crash = seen.get(NUMERICAL)
    # Root cause before crash site: a symptom class that began before the NaN is what fed it
    # (the tanh-MLP case: saturation starves the gradients long before the log-softmax overflows).
    early = [
        c
        for c in (EXPLOSION, VANISHING)
        if c in seen and (crash is None or seen[c]["step"] < crash["step"])
    ]
    if crash is not None and not early:
        cause = NUMERICAL
    elif DEAD_PIPELINE in seen and crash is None:
        cause = DEAD_PIPELINE
    elif early:
        cause = min(early, key=lambda c: seen[c]["step"])  # ties: explosion, as in the pseudo-code
    else:
        cause = next(
            c for c in (REPLICAS, GAP, UNSTEADY, DEAD_LAYER, STRAGGLER, LEAK, DATA) if c in seen
        )
    lead = seen[cause]
    related = [v for v in found if v["pattern"] in CLASSES[cause]]
    if cause in (EXPLOSION, VANISHING) and crash is not None:
        related.append(crash)
    fix = HOT_LR_FIX if cause == EXPLOSION and lead["pattern"] == P.HOT_LR else FIXES[cause]
    return Diagnosis(
        cause,
        _summary(cause, lead, crash),
        _evidence(related),
        fix.format(block=f"block {lead['block']}" if lead.get("block") else "the first layers"),
        lead["step"],
        lead.get("block"),
        [
            f"{c} from step {v['step']}"
            for c, v in seen.items()
            if c != cause and not (c == NUMERICAL and cause in (EXPLOSION, VANISHING))
        ],
    )


def diagnose_events(
    path: str | os.PathLike,
    *,
    job_dirs: Iterable[str | os.PathLike] = (),
    ledger: str | os.PathLike | None = None,
) -> Diagnosis:
    """Diagnose a run from its event log and the incident records of its job folder.

    Args:
        path: a run's ``events.jsonl`` (or the run folder holding it): step reports (lines
            without an "event" key or with ``"event": "step"``) and ``"event": "validation"``
            lines with "step" and "loss".
        job_dirs: folders holding the job's ``incidents/`` besides the run folder and the
            ledger's (the shared ``checkpoint_dir``, when it is elsewhere).
        ledger: the watchdog's ledger, whose folder is the checkpoint folder (default: found in
            or below the run folder).

    Returns:
        The Diagnosis.

    Raises:
        OSError: the file cannot be read, or a folder of ``job_dirs`` is not one.
        ValueError: a line is not JSON, or the log holds no step report.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "events.jsonl")
    incidents, problems = read_incidents(
        job_folders(os.path.dirname(os.path.abspath(path)), job_dirs, ledger=ledger)
    )
    verdicts: list[Mapping[str, Any]] = []
    losses: list[tuple[int, float]] = []
    validation: list[tuple[int, float]] = []
    for event in read_events(path):
        if not isinstance(event, dict):
            continue
        kind = event.get("event", "step")
        if kind == "validation" and "step" in event:
            validation.append((int(event["step"]), json_number(event.get("loss"))))
        elif kind == "step" and "step" in event:
            losses.append((int(event["step"]), json_number(event.get("loss", math.nan))))
            verdicts += [
                _with_loss_ranks(v, event.get("nonfinite_ranks"))
                for v in event.get("verdicts") or []
                if isinstance(v, dict)
            ]
    if not losses:
        raise ValueError(f"{path}: no step reports in the event log")
    diagnosis = diagnose(verdicts, losses, validation, incidents)
    diagnosis.incidents += [f"unreadable: {p}" for p in problems]
    return diagnosis


def _with_loss_ranks(verdict: dict[str, Any], ranks: Any) -> dict[str, Any]:
    """A non-finite loss verdict with the ranks whose own loss was NaN/Inf (the step report's
    ``nonfinite_ranks``) in its evidence, where the verdict does not name them itself."""
    evidence = verdict.get("evidence")
    if (
        verdict.get("pattern") != P.NONFINITE_LOSS
        or not isinstance(ranks, list)
        or not ranks
        or not isinstance(evidence, dict)
        or "ranks" in evidence
        or "rank" in evidence
    ):
        return verdict
    return {**verdict, "evidence": {**evidence, "ranks": ranks}}


def _responses(found: list[dict[str, Any]]) -> list[str]:
    """One line per response verdict, oldest first (a directive repeats: once per action)."""
    lines: list[str] = []
    for v in sorted(found, key=lambda v: v["step"]):
        template = RESPONSES.get(v["pattern"])
        if template is None:
            continue
        evidence = v["evidence"] if isinstance(v["evidence"], dict) else {}
        ev = {k: "?" for k in ("reason", "exit_code", "action")} | evidence
        ev.setdefault("why", f"too many rollbacks, last: {ev['reason']}")  # older event logs
        line = template.format(**ev)
        if not any(seen.endswith(line) for seen in lines):
            lines.append(f"step {v['step']}: {line}")
    return lines


def _as_dict(v: Any) -> dict[str, Any] | None:
    d = v.to_dict() if isinstance(v, Verdict) else dict(v) if isinstance(v, Mapping) else None
    if d is None or "pattern" not in d or "step" not in d:
        return None
    d.setdefault("evidence", {})
    return d


def _earliest(found: list[dict[str, Any]], patterns: tuple[str, ...]) -> dict[str, Any] | None:
    hits = [v for v in found if v["pattern"] in patterns]
    # Same step: the pattern listed first in the class leads (hot_lr before loss_spike).
    return min(hits, key=lambda v: (v["step"], patterns.index(v["pattern"])), default=None)


def _from_curves(
    found: list[dict[str, Any]],
    losses: list[tuple[int, float]],
    validation: list[tuple[int, float]],
) -> list[dict[str, Any]]:
    """Verdict-shaped symptoms read from the loss curves, where no verdict reported them."""
    have = {v["pattern"] for v in found}
    extra = []
    bad = [(s, x) for s, x in losses if not math.isfinite(x)]
    if bad and not have & set(CLASSES[NUMERICAL]):
        extra.append(
            {
                "pattern": P.NONFINITE_LOSS,
                "step": bad[0][0],
                "block": None,
                "evidence": {"loss": bad[0][1], "source": "loss curve"},
            }
        )
    if len(validation) >= 4 and P.GENERALIZATION_GAP not in have:
        # The detector's reading: the last 3 validations rising past their best by 2% while the
        # training loss (EMA, as of each validation) keeps falling.
        recent = validation[-4:]
        val = [x for _, x in recent]
        train = [_ema_at(losses, s) for s, _ in recent]
        best = min(x for _, x in validation)
        rising = all(b > a for a, b in pairwise(val)) and val[-1] >= 1.02 * best
        if rising and all(b < a for a, b in pairwise(train)):
            extra.append(
                {
                    "pattern": P.GENERALIZATION_GAP,
                    "step": recent[1][0],
                    "block": None,
                    "evidence": {
                        "validation": val,
                        "best_validation": best,
                        "source": "validation curve",
                    },
                }
            )
    return extra


def _ema_at(losses: list[tuple[int, float]], step: int) -> float:
    ema = math.nan
    for s, x in losses:
        if s > step:
            break
        if math.isfinite(x):
            ema = x if math.isnan(ema) else 0.9 * ema + 0.1 * x
    return ema


def _summary(cause: str, lead: dict[str, Any], crash: dict[str, Any] | None) -> str:
    at = f"step {lead['step']}" + (f" in block {lead['block']}" if lead.get("block") else "")
    crashed = (
        f", and the run crashed with {crash['pattern']} at step {crash['step']}: the crash "
        f"site and the root cause are far apart"
        if crash is not None and crash is not lead
        else ""
    )
    text = {
        NUMERICAL: f"The run went non-finite ({lead['pattern']}) at {at} with no earlier explosion "
        f"or vanishing signal, pointing at an overflow in log/exp, a division or the precision",
        EXPLOSION: (
            f"The learning rate is too high: the update ratio ran hot (hot_lr) at {at} "
            f"ahead of the gradients and the loss{crashed}"
            if lead["pattern"] == P.HOT_LR
            else f"Gradients exploded, first seen as {lead['pattern']} at {at}{crashed}"
        ),
        # A NaN after vanishing gradients is the saturated units' log-softmax overflowing.
        VANISHING: (
            "Dead ReLUs starve the gradients"
            if lead["pattern"] == P.DEAD_RELU and crash is None
            else "Saturation-driven vanishing gradients"
            if crash is not None or lead["pattern"] in (P.SATURATION, P.ATTENTION_SATURATION)
            else "Gradients vanish"
        )
        + f", first seen as {lead['pattern']} at {at}{crashed}",
        DEAD_PIPELINE: "The loss was flat from the start with ~zero gradients "
        f"(dead pipeline at {at}): the graph, the data or the loss is miswired",
        GAP: f"Training loss falls while validation loss rises from {at}: overfitting, not an "
        f"optimization failure",
        DEAD_LAYER: f"Block {lead.get('block')} barely moves from step {lead['step']} while the "
        f"others train: frozen, left out of the optimizer, or given a zero learning rate",
        STRAGGLER: f"Rank {lead['evidence'].get('rank', '?')} is a straggler from step "
        f"{lead['step']}"
        + (f" ({lead['evidence']['cause']})" if "cause" in lead["evidence"] else ""),
        REPLICAS: (
            f"The loss of step {lead['step']} did not reproduce when computed again (ranks "
            f"{lead['evidence'].get('ranks', '?')}): a transient fault, silent data corruption "
            "or a failing accelerator"
            if lead["pattern"] == P.TRANSIENT_FAULT
            else f"The DDP replicas' weights differed at step {lead['step']} (ranks "
            f"{lead['evidence'].get('ranks', '?')}): silent data corruption or a write to one "
            "replica"
        ),
        LEAK: f"Memory ({lead['evidence'].get('memory', '?')}) rose at every sample up to step "
        f"{lead['step']}: a leak that ends in an out-of-memory kill",
        DATA: f"The ranks waited for data most of each step from step {lead['step']}",
        UNSTEADY: (
            f"The loss climbed slowly from step {lead['step']} (loss_divergence): its rolling "
            f"median rose {lead['evidence'].get('rise', math.nan):.0%} above the lowest it reached"
            if lead["pattern"] == P.LOSS_DIVERGENCE
            else f"The training was unsteady ({lead['pattern']} at {at}) but never spiked for "
            "two steps: nothing graver followed"
        ),
    }[cause]
    return text + "."


def _evidence(verdicts: list[dict[str, Any]], limit: int = 8) -> list[str]:
    """One line per (pattern, block), earliest first: critical verdicts repeat every step."""
    lines, keys = [], set()
    for v in sorted(verdicts, key=lambda v: v["step"]):
        key = (v["pattern"], v.get("block"))
        if key in keys:
            continue
        keys.add(key)
        where = f" in {v['block']}" if v.get("block") else ""
        lines.append(f"step {v['step']}: {v['pattern']}{where} ({_values(v)})".replace(" ()", ""))
    return lines[:limit]


def _values(v: dict[str, Any]) -> str:
    ev = v.get("evidence") or {}
    names = SHOWN.get(v["pattern"]) or [k for k, x in ev.items() if isinstance(x, (int, float))][:3]
    return ", ".join(f"{k}={_fmt(ev[k])}" for k in names if ev.get(k) not in (None, [], ""))


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_fmt(y) for y in x[:5]) + (", ..." if len(x) > 5 else "") + "]"
    return str(x)
