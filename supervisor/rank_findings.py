"""What one node's supervisor finds about its ranks when the job stops: typed, bounded records
that travel between the nodes through the job's store.

    finding = RankFinding(rank=3, node=1, host="h", pid=4711, step=41, beat_age_s=9.5, state="T")
    death = RankDeath(rank=2, node=1, host="h", pid=4712, at=1.7e9, status=13, revision=812)
    mine = NodeFindings(node=1, host="h", key="hang-a0002", ranks=(finding,), taken_at=t)
    text = mine.as_of(asked).to_json()       # the ages as of the moment the nodes share
    NodeFindings.from_json(text)             # any node reads it back, field by field

A hang is told from ``RankFinding`` (each rank's process state, heartbeat step and age, and
Python stack), a crash from ``RankDeath`` (how each rank's process ended, and the store's revision
of the moment its node saw it). Each node publishes its own under the incident's key; the decision
(``blame``) is made on the union, so every node computes the same culprit.

No decision compares one host's wall clock with another's (hosts' clocks may be seconds or
minutes apart): a heartbeat's age is its rank's clock against its own supervisor's, one host's,
taken as of the moment its node asked for the findings or saw the ask (``as_of``, on that host's
monotonic clock); deaths are put in order by the store's revisions. The unix times the records
also carry are for people. Bounded: a stack travels as a short excerpt of its innermost frames,
and a node sends at most ``MAX_RANKS`` ranks. Plain JSON read back with its types checked;
nothing in it is executed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

STACK_EXCERPT_CHARS = 1500
"""A rank's stack as published: its innermost frames up to this many characters (the frame a
rank spins in, or the collective it waits in, is the innermost)."""

STACK_EXCERPT_FRAMES = 12
"""Frames of a rank's training thread published, innermost first."""

MAX_RANKS = 256
"""Ranks one node publishes at most (a node holds 8 in practice; the bound keeps a runaway out
of the store)."""

GONE = "gone"
"""A rank's state when its process no longer exists (or is a zombie)."""

STOPPED_STATES = ("T", "t")
"""/proc states of a stopped process: SIGSTOP (T), stopped under a tracer (t)."""


@dataclass(frozen=True, kw_only=True)
class RankFinding:
    """One rank, looked at while the job hangs."""

    rank: int
    """The global rank (its heartbeat's)."""
    node: int
    """The node its supervisor runs on."""
    host: str
    pid: int
    step: int
    """Its heartbeat's step."""
    beat_time: float = 0.0
    """Unix seconds of its last heartbeat's progress, its host's clock: for people (no decision
    compares it with another host's)."""
    beat_age_s: float | None = None
    """Seconds since its last heartbeat's progress, as of the moment its node asked for the
    findings or saw the ask: its own clock against its supervisor's, one host's (None:
    unknown)."""
    state: str = GONE
    """Its /proc state: R running, S sleeping, D uninterruptible, T stopped, t traced, or
    ``GONE``."""
    asked: bool = False
    """Whether it was sent its stack signal (not when stopped, gone, or none registered)."""
    stack: str = ""
    """The innermost frames of its training thread, innermost first ("" none)."""
    waiting: bool | None = None
    """Whether that stack is in a collective or a wait of torch (None: no stack)."""
    frame: str | None = None
    """Where it is: the innermost frame it waits in (``File ".../distributed_c10d.py", line
    3252 in all_reduce``), else its innermost frame of user code (``File "x.py", line 12 in
    spin``)."""

    def summary(self) -> dict[str, Any]:
        """The record without its stack (what an incident lists for every rank)."""
        out = asdict(self)
        out.pop("stack")
        return out


@dataclass(frozen=True, kw_only=True)
class RankDeath:
    """One rank's process, first seen gone."""

    rank: int | None
    """The global rank (None: a pid no heartbeat named)."""
    node: int
    host: str
    pid: int
    at: float
    """Unix seconds it was first seen gone (exact where the kernel said so: a pidfd), its node's
    clock: orders the deaths of one node, and is for people across nodes."""
    status: int | None = None
    """How it ended: an exit status (>= 0) or minus the signal that killed it; None unknown."""
    line: str = ""
    """The launcher's own report of it (torchrun's ``failed (exitcode: 13) ...`` line)."""
    revision: int | None = None
    """The store's revision of its node's record of it, written the moment it was seen: the
    order of the deaths across nodes (None: not recorded, one node alone or the store away)."""


@dataclass(frozen=True, kw_only=True)
class NodeFindings:
    """Everything one node found for one incident key."""

    node: int
    host: str
    key: str
    """The incident's key (``hang-a0002``, ``crash-a0002-r1``)."""
    ranks: tuple[RankFinding, ...] = ()
    deaths: tuple[RankDeath, ...] = ()
    taken_at: float | None = field(default=None, compare=False)
    """This host's monotonic seconds when the ranks' heartbeat ages were taken (None: no ages,
    or already as of the shared moment). Never sent: another host's monotonic clock means
    nothing here."""

    def as_of(self, at: float) -> NodeFindings:
        """These findings with each heartbeat age as it was at ``at`` (this host's monotonic
        seconds): the moment this node asked the others, or saw another node's ask, which the
        nodes share to within a store poll.

        Args:
            at: the moment, on the clock ``taken_at`` was read from.

        Returns:
            The findings, ``taken_at`` cleared (their ages now count to ``at``).
        """
        if self.taken_at is None:
            return self
        shift = at - self.taken_at
        ranks = tuple(
            r if r.beat_age_s is None else replace(r, beat_age_s=max(0.0, r.beat_age_s + shift))
            for r in self.ranks
        )
        return replace(self, ranks=ranks, taken_at=None)

    def to_json(self) -> str:
        return json.dumps(
            {
                "node": self.node,
                "host": self.host,
                "key": self.key,
                "ranks": [
                    {**asdict(r), "stack": r.stack[:STACK_EXCERPT_CHARS]}
                    for r in self.ranks[:MAX_RANKS]
                ],
                "deaths": [asdict(d) for d in self.deaths[:MAX_RANKS]],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> NodeFindings:
        """A published record, read back.

        Raises:
            ValueError: it is not one (the message names the field).
        """
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("findings: not a JSON object")
        ranks = _list(data, "ranks")[:MAX_RANKS]
        deaths = _list(data, "deaths")[:MAX_RANKS]
        return cls(
            node=_field(data, "node", int),
            host=_field(data, "host", str),
            key=_field(data, "key", str),
            ranks=tuple(_rank(r) for r in ranks),
            deaths=tuple(_death(d) for d in deaths),
        )


def _list(data: dict, name: str) -> list:
    value = data.get(name) or []
    if not isinstance(value, list):
        raise ValueError(f"findings: {name}: not a list")
    return value


def _field(data: Any, name: str, kind: type, *, optional: bool = False) -> Any:
    if not isinstance(data, dict):
        raise ValueError("findings: an entry is not a JSON object")
    value = data.get(name)
    if value is None and optional:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"findings: {name}: expected {kind.__name__}, got {value!r:.60}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"findings: {name}: not a finite number ({value!r})")
    return value


def _rank(d: Any) -> RankFinding:
    return RankFinding(
        rank=_field(d, "rank", int),
        node=_field(d, "node", int),
        host=_field(d, "host", str),
        pid=_field(d, "pid", int),
        step=_field(d, "step", int),
        beat_time=_field(d, "beat_time", float, optional=True) or 0.0,
        beat_age_s=_field(d, "beat_age_s", float, optional=True),
        state=_field(d, "state", str),
        asked=bool(_field(d, "asked", bool, optional=True)),
        stack=(_field(d, "stack", str, optional=True) or "")[:STACK_EXCERPT_CHARS],
        waiting=_field(d, "waiting", bool, optional=True),
        frame=_field(d, "frame", str, optional=True),
    )


def _death(d: Any) -> RankDeath:
    return RankDeath(
        rank=_field(d, "rank", int, optional=True),
        node=_field(d, "node", int),
        host=_field(d, "host", str),
        pid=_field(d, "pid", int),
        at=_field(d, "at", float),
        status=_field(d, "status", int, optional=True),
        line=(_field(d, "line", str, optional=True) or "")[:STACK_EXCERPT_CHARS],
        revision=_field(d, "revision", int, optional=True),
    )
