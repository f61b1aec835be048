"""What one node's supervisor finds about its ranks when the job stops: typed, bounded records
that travel between the nodes through the job's store.

    finding = RankFinding(rank=3, node=1, host="h", pid=4711, step=41, state="T")
    death = RankDeath(rank=2, node=1, host="h", pid=4712, at=1.7e9, status=13)
    text = NodeFindings(node=1, host="h", key="hang-a0002", ranks=(finding,)).to_json()
    NodeFindings.from_json(text)             # any node reads it back, field by field

A hang is told from ``RankFinding`` (each rank's process state, heartbeat step and Python stack),
a crash from ``RankDeath`` (when each rank's process was first seen gone, and how it ended). Each
node publishes its own under the incident's key; the decision (``localize``) is made on the union,
so every node computes the same culprit. Bounded: a stack travels as a short excerpt of its
innermost frames, and a node sends at most ``MAX_RANKS`` ranks. Plain JSON read back with its
types checked; nothing in it is executed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
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
    """Unix seconds of its last heartbeat write."""
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
    """Unix seconds it was first seen gone (exact where the kernel said so: a pidfd)."""
    status: int | None = None
    """How it ended: an exit status (>= 0) or minus the signal that killed it; None unknown."""
    line: str = ""
    """The launcher's own report of it (torchrun's ``failed (exitcode: 13) ...`` line)."""


@dataclass(frozen=True, kw_only=True)
class NodeFindings:
    """Everything one node found for one incident key."""

    node: int
    host: str
    key: str
    """The incident's key (``hang-a0002``, ``crash-a0002-r1``)."""
    ranks: tuple[RankFinding, ...] = ()
    deaths: tuple[RankDeath, ...] = ()

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
    return value


def _rank(d: Any) -> RankFinding:
    return RankFinding(
        rank=_field(d, "rank", int),
        node=_field(d, "node", int),
        host=_field(d, "host", str),
        pid=_field(d, "pid", int),
        step=_field(d, "step", int),
        beat_time=_field(d, "beat_time", float, optional=True) or 0.0,
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
    )
