"""Who caused it: the line the diagnosis leads with.

    rank 1 (node 0, host h): non-finite loss at step 41

From the run's incident records when there are any (the supervisors and global rank 0 name the
culprit's global rank, node and host), else from the verdicts whose evidence names a rank (the
straggler's ``rank``, the non-finite and diverging replicas' ``ranks``). The incident matching
the diagnosed cause leads; else the first one that stopped the job; else the first one.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...records.incidents import Culprit, Incident
from ...records.vocabulary import (
    ABORT,
    CRASH,
    DIVERGENCE,
    HANG,
    LOSS_SPIKE,
    NODE_LOST,
    NONFINITE,
    STRAGGLER,
    TRANSIENT,
)
from ..detect import verdict as P

WHAT = {
    HANG: "hung",
    CRASH: "crashed",
    NODE_LOST: "node lost",
    NONFINITE: "non-finite value",
    LOSS_SPIKE: "loss spike",
    STRAGGLER: "straggler",
    DIVERGENCE: "replica divergence",
    TRANSIENT: "transient fault (the step computed again did not reproduce it)",
    ABORT: "aborted the job",
}
"""What each kind of incident says after the culprit."""

STOPPED = (HANG, CRASH, NODE_LOST, NONFINITE, DIVERGENCE, ABORT)
"""Kinds that stopped the job or corrupted its state: they lead over a straggler or a spike."""

CAUSE_KINDS = {
    "numerical instability": (NONFINITE,),
    "gradient explosion": (LOSS_SPIKE, NONFINITE),
    "vanishing gradients": (NONFINITE,),
    "straggler": (STRAGGLER,),
    "replica divergence": (DIVERGENCE, TRANSIENT),
    "unsteady loss": (LOSS_SPIKE,),
}
"""The diagnosis's cause -> the incident kinds that are its culprit's record."""

VERDICT_WHAT = {
    P.NONFINITE_LOSS: "non-finite loss",
    P.NONFINITE_GRAD: "non-finite gradient",
    P.STRAGGLER: "straggler",
    P.REPLICA_DIVERGENCE: "replica divergence",
    P.LOSS_SPIKE: "loss spike",
    P.LOSS_OUTLIER: "loss outlier (its update skipped)",
    P.GRAD_SPIKE: "gradient spike",
    P.TRANSIENT_FAULT: "transient fault (the step computed again did not reproduce it)",
}
"""Verdicts whose evidence may name the culprit's rank, and what the line calls them."""


@dataclass(frozen=True)
class Lead:
    """The culprit line and where it came from."""

    line: str
    """``rank 1 (node 0, host h): non-finite loss at step 41``."""
    cause: str = ""
    """The incident's own one-line cause ("" for a verdict's)."""
    source: str = "incident"
    """``incident`` or ``verdict``."""


def who(culprit: Culprit) -> str:
    """``rank 1 (node 0, host h)``, ``node 2 (host h)``, ``an unnamed rank``."""
    named = culprit.describe(pid=False)
    return "an unnamed rank" if named == "unknown" else named


def incident_line(incident: Incident, verdicts: Iterable[Mapping[str, Any]] = ()) -> str:
    """One incident as the lead line: who, what, at which step.

    Args:
        incident: the record.
        verdicts: the run's verdicts (dicts): a non-finite incident is called what the verdict
            of its step called it (a non-finite loss, else gradient), as are the verdicts its
            evidence keeps.
    """
    what = WHAT.get(incident.kind, incident.kind)
    if incident.kind == NONFINITE:
        # The verdicts of its step, in the event log or in the record (the agent keeps them).
        recorded = incident.evidence.get("verdicts")
        seen = [v for v in verdicts if v.get("step") == incident.step]
        seen += [v for v in recorded if isinstance(v, dict)] if isinstance(recorded, list) else []
        patterns = {v.get("pattern") for v in seen}
        pattern = next((p for p in (P.NONFINITE_LOSS, P.NONFINITE_GRAD) if p in patterns), "")
        what = VERDICT_WHAT.get(pattern, what)
    step = "" if incident.step is None else f" at step {incident.step}"
    return f"{who(incident.culprit)}: {what}{step}"


def from_incidents(
    incidents: Sequence[Incident], cause: str, verdicts: Sequence[Mapping[str, Any]] = ()
) -> Lead | None:
    """The incident to lead with for the diagnosed ``cause``; None when no incident names a
    culprit (a spike every rank shares names none: "an unnamed rank" would lead the diagnosis
    with nothing; the incidents are still listed)."""
    named = [i for i in incidents if i.culprit != Culprit()]
    if not named:
        return None
    matching = [i for i in named if i.kind in CAUSE_KINDS.get(cause, ())]
    stopped = [i for i in named if i.kind in STOPPED]
    lead = (matching or stopped or named)[0]  # the list is oldest first
    return Lead(incident_line(lead, verdicts), lead.cause)


def from_verdicts(verdicts: Iterable[Mapping[str, Any]], cause: str) -> Lead | None:
    """The first verdict whose evidence names a rank (the diagnosed cause's first); None when
    no verdict does."""
    named = []
    for v in verdicts:
        what = VERDICT_WHAT.get(v.get("pattern", ""))
        ranks = _ranks(v.get("evidence") or {})
        if what is not None and ranks:
            named.append((v, what, ranks))
    if not named:
        return None
    named.sort(key=lambda x: x[0]["step"])
    kinds = {
        NONFINITE: (P.NONFINITE_LOSS, P.NONFINITE_GRAD),
        STRAGGLER: (P.STRAGGLER,),
        DIVERGENCE: (P.REPLICA_DIVERGENCE,),
        LOSS_SPIKE: (P.LOSS_SPIKE, P.LOSS_OUTLIER, P.GRAD_SPIKE),
    }
    patterns = {p for k in CAUSE_KINDS.get(cause, ()) for p in kinds.get(k, ())}
    v, what, ranks = next((x for x in named if x[0]["pattern"] in patterns), named[0])
    evidence = v.get("evidence") or {}
    culprit = Culprit(
        rank=ranks[0],
        node=evidence.get("node") if isinstance(evidence.get("node"), int) else None,
        host=evidence.get("host") if isinstance(evidence.get("host"), str) else None,
    )
    others = f" (also rank{'s' if len(ranks) > 2 else ''} {', '.join(map(str, ranks[1:]))})"
    return Lead(
        f"{who(culprit)}: {what} at step {v['step']}" + (others if len(ranks) > 1 else ""),
        source="verdict",
    )


def _ranks(evidence: Mapping[str, Any]) -> list[int]:
    """The global ranks a verdict's evidence names: ``rank``, or the list ``ranks``."""
    rank = evidence.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool):
        return [rank]
    ranks = evidence.get("ranks")
    if isinstance(ranks, (list, tuple)):
        return [r for r in ranks if isinstance(r, int) and not isinstance(r, bool)]
    return []
