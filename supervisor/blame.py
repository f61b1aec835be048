"""Who stopped the job: the rules naming the culprit of a hang or a crash (a ``Blame``), from
every node's findings.

    ranks, deaths = union(findings_of_every_node)
    blame = blame_hang(ranks)         # Blame(culprit, cause, rule, evidence)
    blame = blame_crash(deaths)       # None: no rank's death was seen

Pure functions of the findings, sorted before they are read, so every node that holds the same
findings names the same culprit (the incident's first writer wins, whichever node it is). No rule
compares one host's wall clock with another's: hosts' clocks may be seconds or minutes apart,
while ranks fail milliseconds apart. What orders events across nodes is what they share: step
numbers, the store's revisions, and durations each host measured on its own clock.

A hang's culprit, first rule that names one:

1. ``stopped``: a rank whose process is stopped (``T``: SIGSTOP; ``t``: under a tracer).
2. ``gone``: a rank whose process is gone while others still run.
3. ``spinning``: a rank whose stack shows no collective while other ranks' stacks wait in one
   (it runs user code, or waits on something else: its innermost user frame is the evidence).
4. ``silent``: a rank asked for its stack that did not answer while others answered from a
   collective (uninterruptible sleep, a signal handler that cannot run).
5. ``behind``: the rank(s) with the lowest heartbeat step whose heartbeat is older than every
   other rank's by more than the slack (``BEAT_SLACK_S``, plus the moments apart at which the
   nodes took their ages). A heartbeat's age is its own host's: its rank's clock at the write
   against its supervisor's at the look.
6. none: every rank waits alike; the culprit is null and the evidence lists them all.

A crash's culprit: the rank whose death its node recorded first in the store (the lowest
revision), with its exit status or signal. Deaths one node saw are in the order of its own clock
(the revisions agree with it); a death the store never recorded (one node alone, or the store
away) comes after every recorded one, then by node, then by its node's clock; ties: the lower
rank.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..records.incidents import Culprit
from .rank_findings import GONE, STOPPED_STATES, NodeFindings, RankDeath, RankFinding

BEAT_SLACK_S = 2.0
"""The agents write their heartbeat at most once a second: two ranks' heartbeat ages less than
this apart say nothing about which of them stopped first."""

LISTED_RANKS = 64
"""Ranks an incident lists in its evidence (the culprit and the others' summaries)."""


@dataclass(frozen=True)
class Blame:
    """The culprit of one disruption (a hang or a crash of the job) and what proves it; not the
    agent's per-step ``Verdict`` (``agent.detect.verdict``)."""

    culprit: Culprit
    """Null fields where unknown (``Culprit()``: no rank stands out)."""
    cause: str
    """One line: ``rank 3 (node 1, host h, pid 4711) is stopped (SIGSTOP)``."""
    rule: str
    """Which rule named it (``stopped``, ``spinning``, ``first death``...; ``none``)."""
    evidence: dict[str, Any] = field(default_factory=dict)


def union(
    findings: Sequence[NodeFindings],
) -> tuple[tuple[RankFinding, ...], tuple[RankDeath, ...]]:
    """Every node's findings as one, in a fixed order (by rank, then node); a rank reported by
    two nodes (a stale heartbeat folder) counts once, the lower node's."""
    ranks: dict[int, RankFinding] = {}
    for f in sorted(findings, key=lambda f: f.node):
        for r in f.ranks:
            ranks.setdefault(r.rank, r)
    deaths = {(d.node, d.pid): d for f in findings for d in f.deaths}
    return (
        tuple(ranks[r] for r in sorted(ranks)),
        tuple(sorted(deaths.values(), key=_death_order)),
    )


def culprit_of(r: RankFinding | RankDeath) -> Culprit:
    return Culprit(rank=r.rank, node=r.node, host=r.host, pid=r.pid)


def blame_hang(ranks: Sequence[RankFinding], *, slack_s: float = BEAT_SLACK_S) -> Blame:
    """The culprit of a hang, from every rank's finding (see the module's rules).

    Args:
        ranks: every node's ranks.
        slack_s: heartbeat ages less than this apart do not make a rank ``behind``.

    Returns:
        The culprit, the rule that named it and its evidence.
    """
    ranks = sorted(ranks, key=lambda r: (r.rank, r.node))
    listed = [r.summary() for r in ranks[:LISTED_RANKS]]
    alive = [r for r in ranks if r.state != GONE]
    waiting = [r for r in alive if r.waiting]
    top = max((r.step for r in ranks), default=None)

    def named(rule: str, suspects: list[RankFinding], cause: str, **more: Any) -> Blame:
        first = suspects[0]
        evidence = {
            "rule": rule,
            "state": first.state,
            "step": first.step,
            "frame": first.frame,
            "stack": first.stack,
            "suspects": [r.rank for r in suspects],
            **more,
            "ranks": listed,
        }
        return Blame(culprit_of(first), f"{culprit_of(first).describe()} {cause}", rule, evidence)

    stopped = [r for r in alive if r.state in STOPPED_STATES]
    if stopped:
        how = "(SIGSTOP)" if stopped[0].state == "T" else "under a tracer"
        return named("stopped", stopped, f"is stopped {how}")
    gone = [r for r in ranks if r.state == GONE]
    if gone and alive:
        return named("gone", gone, "is gone (its process exited) while the others still run")
    busy = [r for r in alive if r.waiting is False]
    if busy and waiting:
        return named(
            "spinning",
            busy,
            f"is not in a collective: it runs {busy[0].frame} while {_ranks(waiting)} "
            f"{_verb(waiting)} in one",
            waiting=[r.rank for r in waiting],
        )
    silent = [r for r in alive if r.asked and r.waiting is None]
    if silent and waiting:
        return named(
            "silent",
            silent,
            f"does not answer its stack signal (state {silent[0].state}) while "
            f"{_ranks(waiting)} {_verb(waiting)} in a collective",
            waiting=[r.rank for r in waiting],
        )
    behind = _behind(alive, slack_s)
    if behind:
        youngest = min(r.beat_age_s for r in alive if r.beat_age_s is not None)
        age = behind[0].beat_age_s or 0.0
        return named(
            "behind",
            behind,
            f"is behind: its last heartbeat says step {behind[0].step}, "
            f"{age - youngest:.0f} s older than the others' (step {top})",
            slack_s=round(slack_s, 3),
        )
    if not alive:
        cause = "no rank runs: every rank's process is gone (a start or a restart that hangs)"
    else:
        where = "in a collective" if len(waiting) == len(alive) else "alike"
        cause = f"no rank stands out: every rank waits {where} (step {top})"
    return Blame(Culprit(), cause, "none", {"rule": "none", "step": top, "ranks": listed})


def _behind(alive: list[RankFinding], slack_s: float) -> list[RankFinding]:
    """The ranks at the lowest step whose heartbeat is older than every higher rank's by more
    than ``slack_s`` (ages only: each measured on its own host; a rank without one is not
    judged)."""
    aged = [r for r in alive if r.beat_age_s is not None]
    if len(aged) < 2:
        return []
    low = min(r.step for r in aged)
    others = [r.beat_age_s for r in aged if r.step > low and r.beat_age_s is not None]
    if not others:
        return []
    oldest_other = max(others)
    return [
        r
        for r in aged
        if r.step == low and r.beat_age_s is not None and r.beat_age_s > oldest_other + slack_s
    ]


def _ranks(found: list[RankFinding]) -> str:
    names = [str(r.rank) for r in found[:8]]
    more = f" and {len(found) - 8} more" if len(found) > 8 else ""
    return ("rank " if len(found) == 1 else "ranks ") + ", ".join(names) + more


def _verb(found: list[RankFinding]) -> str:
    return "waits" if len(found) == 1 else "wait"


def _death_order(d: RankDeath) -> tuple:
    # The store's revision first: the one order every node shares. ``at`` is only compared
    # between deaths of one node (one clock): the revisions come before it and are unique, so
    # it decides among the unrecorded deaths of one node alone.
    return (
        d.revision is None,
        d.revision or 0,
        d.node,
        d.at,
        d.rank if d.rank is not None else 1 << 30,
        d.pid,
    )


def ended_by(status: int | None) -> str:
    """``exit status 13``, ``killed by SIGKILL``, or ``exit status unknown``."""
    if status is None:
        return "exit status unknown"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def blame_crash(deaths: Sequence[RankDeath]) -> Blame | None:
    """The rank that died first, across nodes (None: no rank's death was seen): the first the
    store recorded (see the module's order)."""
    deaths = sorted(deaths, key=_death_order)
    if not deaths:
        return None
    first = deaths[0]
    who = culprit_of(first)
    status = first.status
    killed = status is not None and status < 0
    evidence = {
        "rule": "first death",
        "exit_status": None if status is None or killed else status,
        "signal": ended_by(status).removeprefix("killed by ") if killed else None,
        "died_at": first.at,
        "revision": first.revision,
        "torchrun": first.line or None,
        # In the order of the decision; ``at`` is each death's own host's clock (for people:
        # two hosts' readings are not comparable), ``revision`` the store's order.
        "deaths": [
            {
                "rank": d.rank,
                "node": d.node,
                "host": d.host,
                "pid": d.pid,
                "at": d.at,
                "status": d.status,
                "revision": d.revision,
            }
            for d in deaths[:LISTED_RANKS]
        ],
    }
    name = (
        who.describe()
        if first.rank is not None
        else f"the worker with pid {first.pid} on node {first.node} (host {first.host})"
    )
    return Blame(who, f"{name} died first: {ended_by(status)}", "first death", evidence)
