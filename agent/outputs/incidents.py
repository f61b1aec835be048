"""Global rank 0's incidents: each disruption the step's verdicts name, one record in the job's
folder, with the rank, node, host and pid that caused it.

    places = gather_places(group, rank, world_size)      # once, at watch(): every rank calls it
    writer = IncidentWriter(IncidentLog(folder), places, attempt=2)   # global rank 0 only
    writer.seen(report, detector.active.values())        # each step, right after detection
    writer.acted(report)                                 # after the action: a rollback's cost
    writer.aborted(report, verdict)                      # before an abort is raised

The verdicts every rank reached from the step's one reduction say what happened; global rank 0
writes it (``torchvitals.records.incidents``): a non-finite loss or gradient (kind
``nonfinite``, the culprit the rank whose own loss it was, told by the reduction), a loss spike,
a straggler (the slow rank, once per episode, with compute, data wait or communication as its
cause), diverging DDP replicas, and an abort (the loop guard, a collector's order). The record
is written in the step that saw it, before any rollback; when the step rolls back it is updated
with when the job trained again and the wall time thrown away (the steps since the restored
checkpoint, and the restore).

Who a rank is (its host, its node, its pid) is gathered to rank 0 once, at ``watch()``: nothing
per step. The node is the supervisor's (``protocol.NODE_ENV``), else torchrun's ``GROUP_RANK``,
Slurm's ``SLURM_NODEID``, the global rank over the launcher's ranks per node, or, when no
launcher says, the host's order among the job's hosts.

A guest in the training loop: a folder that cannot be written is logged once and the step goes
on; nothing here raises into the training.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ...protocol import ATTEMPT_ENV, NODE_ENV
from ...records.incidents import Culprit, Incident, IncidentLog, hostname
from ...records.vocabulary import (
    ABORT,
    DIVERGENCE,
    LOSS_SPIKE,
    NONFINITE,
    STRAGGLER,
    TRANSIENT,
)
from ..detect import verdict as patterns
from ..detect.verdict import Verdict
from ..jsonsafe import json_safe
from ..report import Action, Report
from .ports import LOCAL_SIZE_VARS

log = logging.getLogger(__name__)

NODE_VARS = (NODE_ENV, "GROUP_RANK", "SLURM_NODEID")
"""Where a rank's node rank is read from, first set wins (then the ranks per node)."""

ENDS_KEPT = 10_000
"""Step end times kept for a rollback's cost (a rollback further back is costed from the
oldest kept)."""


# ---------------------------------------------------------------- who each rank is


def node_rank(rank: int, env: Mapping[str, str] | None = None) -> int | None:
    """This rank's node: ``NODE_VARS``, else ``rank // ranks per node`` when a launcher says how
    many; None when nothing says."""
    env = os.environ if env is None else env
    for name in NODE_VARS:
        with contextlib.suppress(ValueError):
            if env.get(name, "").strip():
                return int(env[name])
    for name in LOCAL_SIZE_VARS:
        with contextlib.suppress(ValueError):
            size = int(env.get(name, ""))
            if size > 0:
                return rank // size
    return None


def supervisor_attempt(env: Mapping[str, str] | None = None) -> int:
    """The supervisor's attempt (``protocol.ATTEMPT_ENV``); 0 when unsupervised."""
    env = os.environ if env is None else env
    try:
        return max(0, int(env.get(ATTEMPT_ENV, "0") or 0))
    except ValueError:
        return 0


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_places(group: Any, rank: int, world_size: int) -> dict[int, Culprit] | None:
    """Every rank's global rank, node, host and pid, on rank 0 of ``group``; once, at
    ``watch()`` (collective: every rank calls it).

    Returns:
        Group rank -> its ``Culprit`` on rank 0 (None on the other ranks, and where the gather
        failed: the incidents then name the rank alone).
    """
    me = _global_rank()
    mine = (me, node_rank(me), hostname(), os.getpid())
    gathered: list[Any] | None = [mine]
    if world_size > 1:
        gathered = [None] * world_size if rank == 0 else None
        try:
            dist.gather_object(mine, gathered, group=group, group_dst=0)
        except Exception as exc:  # never stops watch(): the rank alone is still named
            log.warning(
                "torchvitals: cannot gather the ranks' hosts (%s); incidents name ranks", exc
            )
            return None
    if rank != 0 or gathered is None:
        return None
    hosts = list(dict.fromkeys(entry[2] for entry in gathered))
    return {
        r: Culprit(
            rank=int(g),
            node=hosts.index(host) if node is None else int(node),
            host=str(host),
            pid=int(pid),
        )
        for r, (g, node, host, pid) in enumerate(gathered)
    }


# ---------------------------------------------------------------- the records


def incident_key(
    kind: str, attempt: int, step: int, rank: int | str | None = None, rollbacks: int = 0
) -> str:
    """The key of a disruption: ``nonfinite-a0002-s00000041``, ``straggler-a0000-r3-s00000012``;
    ``loss_spike-a0000-s00000062-x1`` after the attempt's first rollback (``rollbacks``), whose
    replay numbers its steps again: a spike that comes back at the same step is a record of its
    own."""
    who = "" if rank is None else f"-r{rank}"
    again = f"-x{rollbacks}" if rollbacks else ""
    return f"{kind}-a{attempt:04d}{who}-s{step:08d}{again}"


@dataclass
class _Episode:
    """One disruption that may last several steps (a run of skipped non-finite steps, a
    straggler that stays slow, a loss that stays high): one incident, its cost summed while it
    lasts."""

    key: str
    last: int
    """The last step it was seen at."""
    lost: float = 0.0
    remedy: str | None = None
    """What the job did about it, once recorded."""


STEP_KINDS = {
    patterns.NONFINITE_LOSS: NONFINITE,
    patterns.NONFINITE_GRAD: NONFINITE,
    patterns.LOSS_SPIKE: LOSS_SPIKE,
    patterns.REPLICA_DIVERGENCE: DIVERGENCE,
    patterns.TRANSIENT_FAULT: TRANSIENT,
}
"""Verdict pattern -> the incident kind it starts (a straggler's and an abort's are their own)."""


class IncidentWriter:
    """Global rank 0's incidents of one run.

    Args:
        incidents: the job's incident log.
        places: group rank -> who it is (``gather_places``); None: ranks alone.
        attempt: the supervisor's attempt (0 when unsupervised).
        supervised: whether a supervisor runs the job (the record's ``attempt`` field).
        clock: unix seconds.
        on_record: told each incident this writer recorded (the metrics' counter).
    """

    def __init__(
        self,
        incidents: IncidentLog,
        places: dict[int, Culprit] | None,
        *,
        attempt: int = 0,
        supervised: bool = False,
        clock: Callable[[], float] = time.time,
        on_record: Callable[[Incident], None] = lambda incident: None,
    ) -> None:
        self.incidents, self.places = incidents, places or {}
        self.attempt, self.supervised = attempt, supervised
        self._clock, self._on_record = clock, on_record
        self._open: dict[str, _Episode] = {}
        """Kind -> the disruption going on (seen at the last step, not rolled back)."""
        self._stragglers: dict[Any, _Episode] = {}
        self._ends: OrderedDict[int, float] = OrderedDict()
        self._start = clock()
        self._failed = False
        self._rollbacks = 0
        """Rollbacks this attempt took: the replay after each numbers its steps again."""
        self._rolled: list[tuple[int, str]] = []
        """``(step, incident key)`` of each rollback's incident, oldest first (a repeat names
        the one it repeats)."""

    def culprit(self, rank: int | None) -> Culprit:
        """Who group rank ``rank`` is (None: unknown)."""
        if rank is None:
            return Culprit()
        return self.places.get(rank) or Culprit(rank=rank)

    # ------------------------------------------------------------ what the step calls

    def seen(self, report: Report, active: Iterable[Verdict]) -> None:
        """Record the disruptions the step's verdicts name; right after detection, before any
        rollback. ``active``: the detector's verdicts still holding (a straggler's episode)."""
        self._guarded(self._seen, report, active)

    def acted(self, report: Report) -> None:
        """After the step's action: a rollback's or a skip's recovery and cost."""
        self._guarded(self._acted, report)

    def aborted(self, report: Report, verdict: Verdict) -> None:
        """The run gives up at this step (``verdict``: the loop guard's or the collector's)."""
        self._guarded(self._aborted, report, verdict)

    def close(self) -> None:
        """The run ends: what the disruptions still going on cost so far."""
        self._guarded(self._close)

    # ------------------------------------------------------------ the work

    def _seen(self, report: Report, active: Iterable[Verdict]) -> None:
        now = self._clock()
        by = {v.pattern: v for v in report.verdicts}
        kinds = {STEP_KINDS[p] for p in by if p in STEP_KINDS}
        for kind in [k for k in self._open if k not in kinds]:
            over = self._open.pop(kind)  # the job trains on without it
            self._update(over.key, recovered_at=now, lost_seconds=round(over.lost, 6))
        for kind in kinds:
            going = self._open.get(kind)
            if going is not None and going.last == report.step - 1:
                going.last = report.step  # the same disruption, one step longer
                continue
            key = self._start_kind(kind, report, by, now)
            if key is not None:
                self._open[kind] = _Episode(key, report.step)
        self._straggling(report, active, now)

    def _start_kind(
        self, kind: str, report: Report, by: dict[str, Verdict], now: float
    ) -> str | None:
        if kind == NONFINITE:
            return self._nonfinite(report, by, now)
        if kind == LOSS_SPIKE:
            v = by[patterns.LOSS_SPIKE]
            e = v.evidence
            ranks = list(e.get("ranks", []))
            who = (
                _whose(
                    ranks,
                    "own activations were far out, the other ranks' were not",
                    "own activations were far out",
                    "",
                )
                if e.get("culprit_from") == "activations"
                else _whose(
                    ranks,
                    "own loss alone lifted the mean past it",
                    "own losses were far out",
                    "no one rank's loss alone lifted the mean (a spike the ranks share)",
                )
            )
            cause = (
                f"the loss spiked to {e.get('loss', report.loss):.4g}, above "
                f"{e.get('threshold', 0):.4g} (median {e.get('median', 0):.4g}, "
                f"z {e.get('z', 0):.1f}); {who}"
            )
            culprit = ranks[0] if len(ranks) == 1 else None
            return self._record(LOSS_SPIKE, report, culprit, cause, {"verdict": v.to_dict()}, now)
        if kind == TRANSIENT:
            return self._transient(report, by[patterns.TRANSIENT_FAULT], now)
        v = by[patterns.REPLICA_DIVERGENCE]
        ranks = list(v.evidence.get("ranks", []))
        culprit = ranks[0] if len(ranks) == 1 else None
        cause = f"DDP replicas diverged in {len(v.evidence.get('blocks', {}))} block(s)" + (
            f": rank {culprit} differs from the others" if culprit is not None else ""
        )
        return self._record(DIVERGENCE, report, culprit, cause, {"verdict": v.to_dict()}, now)

    def _transient(self, report: Report, v: Verdict, now: float) -> str | None:
        e = v.evidence
        ranks = list(e.get("ranks", []))
        who = _whose(
            ranks,
            "own loss did not come back: suspect its accelerator",
            "own losses did not come back",
            "no one rank's loss alone made it",
        )
        cause = (
            f"the loss of {e.get('loss', report.loss):.4g} (threshold {e.get('threshold', 0):.4g}) "
            f"was {e.get('rerun_loss', 0):.4g} when the step was computed again: a transient "
            f"fault, its update dropped; {who}"
        )
        culprit = ranks[0] if len(ranks) == 1 else None
        return self._record(TRANSIENT, report, culprit, cause, {"verdict": v.to_dict()}, now)

    def _nonfinite(self, report: Report, by: dict[str, Verdict], now: float) -> str | None:
        ranks, count = report.nonfinite_ranks, report.nonfinite_rank_count
        if count == 1:
            cause = f"rank {ranks[0]}'s loss was non-finite"
        elif count == 2:
            cause = f"ranks {ranks[0]} and {ranks[1]}'s losses were non-finite"
        elif count > 2:
            cause = f"{count} ranks' losses were non-finite (which ones cannot be told)"
        else:
            cause = "a non-finite gradient; no rank's own loss was (the rank cannot be told)"
        grad = by.get(patterns.NONFINITE_GRAD)
        if grad is not None and grad.evidence.get("blocks"):
            cause += f"; non-finite gradient in {', '.join(grad.evidence['blocks'][:3])}"
        evidence: dict[str, Any] = {
            "ranks": list(ranks),
            "rank_count": count,
            "loss": report.loss,
            "verdicts": [
                by[p].to_dict()
                for p in (patterns.NONFINITE_LOSS, patterns.NONFINITE_GRAD)
                if p in by
            ],
        }
        culprit = ranks[0] if count in (1, 2) else None
        return self._record(NONFINITE, report, culprit, cause, evidence, now)

    def _straggling(self, report: Report, active: Iterable[Verdict], now: float) -> None:
        current = {v.evidence.get("rank"): v for v in active if v.pattern == patterns.STRAGGLER}
        for rank in [r for r in self._stragglers if r not in current]:
            over = self._stragglers.pop(rank)
            self._update(over.key, recovered_at=now, lost_seconds=round(over.lost, 6))
        for rank, v in current.items():
            e = v.evidence
            episode = self._stragglers.get(rank)
            if episode is None:
                first = max(1, report.step - int(e.get("steps", 1)))
                key = incident_key(STRAGGLER, self.attempt, first, "x" if rank is None else rank)
                episode = self._stragglers[rank] = _Episode(key, report.step)
                evidence = {"verdict": v.to_dict(), "first_slow_step": first}
                self._record(STRAGGLER, report, rank, _straggler_cause(rank, e), evidence, now, key)
            # The job waited for it: its excess over the others, each step it stays slow.
            episode.last = report.step
            episode.lost += max(0.0, float(e.get("seconds", 0)) - float(e.get("others_mean", 0)))

    def _acted(self, report: Report) -> None:
        now = self._clock()
        current = [e for e in self._open.values() if e.last == report.step]
        if report.rollback is not None:
            for stale in [s for s in self._ends if s > report.rollback.to_step]:
                del self._ends[stale]
            # Thrown away: every step since the restored checkpoint, and the restore.
            since = self._ends.get(report.rollback.to_step, self._oldest())
            repeat_of = self._repeated(report.rollback.repeat_of)
            for episode in current:
                lost = round(episode.lost + now - since, 6)
                self._update(
                    episode.key,
                    recovered_at=now,
                    lost_seconds=lost,
                    remedy=report.remedy,
                    repeat_of=repeat_of,
                )
                self._rolled.append((report.step, episode.key))
            self._rollbacks += 1
            self._open = {k: e for k, e in self._open.items() if e not in current}
            return
        for episode in current:  # what the job did about it, said once
            if episode.remedy is None:
                episode.remedy = report.remedy
                self._update(episode.key, remedy=report.remedy)
        if report.action == Action.SKIP:
            last = next(reversed(self._ends.values()), self._start)
            for episode in current:
                episode.lost += now - last  # a whole step whose work was dropped
        self._ends[report.step] = now
        self._ends.move_to_end(report.step)
        while len(self._ends) > ENDS_KEPT:
            self._ends.popitem(last=False)

    def _aborted(self, report: Report, verdict: Verdict) -> None:
        if verdict.pattern == patterns.ROLLBACK_LOOP:
            why = verdict.evidence.get("why") or (
                f"too many rollbacks, last: {verdict.evidence.get('reason', '')}"
            )
            cause = f"gave up ({why}): exit code {verdict.evidence.get('exit_code')}"
        elif verdict.pattern == patterns.COLLECTOR_DIRECTIVE:
            cause = "the collector ordered the run aborted"
        else:
            cause = f"aborted: {verdict.pattern}"
        self._record(
            ABORT, report, None, cause, {"verdict": verdict.to_dict()}, self._clock(), remedy=ABORT
        )

    def _repeated(self, step: int | None) -> str | None:
        """The key of the incident of the last rollback taken at ``step`` (None: none)."""
        if step is None:
            return None
        return next((key for s, key in reversed(self._rolled) if s == step), None)

    def _close(self) -> None:
        for episode in [*self._open.values(), *self._stragglers.values()]:
            self._update(episode.key, lost_seconds=round(episode.lost, 6))
        self._open, self._stragglers = {}, {}

    # ------------------------------------------------------------ writing

    def _record(
        self,
        kind: str,
        report: Report,
        rank: int | None,
        cause: str,
        evidence: dict[str, Any],
        at: float,
        key: str | None = None,
        remedy: str | None = None,
    ) -> str | None:
        """Write one incident; its key, or None when another writer had it."""
        culprit = self.culprit(rank)
        incident = Incident(
            kind=kind,
            key=key or incident_key(kind, self.attempt, report.step, rollbacks=self._rollbacks),
            remedy=remedy,
            step=report.step,
            culprit=culprit,
            cause=cause,
            evidence=json_safe(evidence),  # NaN as "nan": plain JSON for any reader
            detected_at=at,
            localized_at=at if culprit.rank is not None else None,
            attempt=self.attempt if self.supervised else None,
            writer="agent rank 0",
        )
        if not self.incidents.record(incident):
            return None
        self._on_record(incident)
        return incident.key

    def _update(self, key: str, **changes: Any) -> None:
        self.incidents.update(key, **changes)

    def _oldest(self) -> float:
        return next(iter(self._ends.values()), self._start)

    def _guarded(self, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except Exception:  # an incident must never stop the training it describes
            if not self._failed:
                log.warning(
                    "torchvitals: cannot write an incident into %s; the training goes on "
                    "(later failures are not logged)",
                    self.incidents.path,
                    exc_info=True,
                )
            self._failed = True


def _whose(ranks: list[int], one: str, two: str, none: str) -> str:
    """``rank 3's <one>``, ``ranks 1 and 3's <two>`` (the ranks a step's sums name: one or two
    exactly), else ``none``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}'s {one}"
    if len(ranks) == 2:
        return f"ranks {ranks[0]} and {ranks[1]}'s {two}"
    return none


def _straggler_cause(rank: int | None, e: Mapping[str, Any]) -> str:
    who = "a rank" if rank is None else f"rank {rank}"
    seconds, others = float(e.get("seconds", 0)), float(e.get("others_mean", 0))
    cause = e.get("cause", "compute")
    if cause == "data_wait":
        why = f"data wait ({float(e.get('data_wait_seconds') or 0):.3g} s of its step)"
    elif cause == "communication":
        why = "communication (its compute is normal, its step after the forward pass is not)"
    else:
        why = "compute (its forward, not its data wait)"
    return (
        f"{who} is a straggler: {seconds:.3g} s against the others' {others:.3g} s for "
        f"{int(e.get('steps', 0))} steps; cause: {why}"
    )
