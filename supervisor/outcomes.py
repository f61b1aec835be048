"""How one attempt of the supervised job ended: one frozen class per way.

    outcome = supervisor.history[-1]
    match outcome:
        case Exited(status=0): ...                  # the launcher exited by itself
        case Hung(age_s=age, timeout_s=limit): ...  # no heartbeat advance within the timeout
        case Ordered(order=order): ...              # the job restarted or ended on another node

Every outcome says when the attempt started, when its end was seen and when its processes were
stopped, the launcher's exit status, the ranks' last heartbeat (read once the group was stopped:
"refused" and "aborted" live there) and the key of the incident it made (the culprit: its record
in the job's folder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..protocol import Beat
from .orders import JobEnded, JobRestarted, NodesLost


@dataclass(frozen=True, kw_only=True)
class AttemptEnd:
    """What every ending of an attempt records."""

    reason: ClassVar[str]
    """"exit", "hang", or "peer" (the job restarted or ended on another node's word)."""

    number: int
    """The attempt (1 = the first run)."""
    started: float
    """Wall-clock start."""
    ended: float
    """Wall-clock time the exit, the hang or the order was seen (before the group was
    stopped)."""
    status: int
    """The launcher's exit status (negative: the signal that ended it)."""
    beat: Beat | None = None
    """The ranks' last heartbeat, read after the group was stopped (None: no rank wrote one)."""
    stopped: float | None = None
    """Wall-clock time the group was stopped (after the culprit was named); None: unknown."""
    incident: str | None = None
    """The key of the incident this ending made here (``hang-a0002``), if it made one."""


@dataclass(frozen=True, kw_only=True)
class Exited(AttemptEnd):
    """The launcher exited by itself."""

    reason: ClassVar[str] = "exit"


@dataclass(frozen=True, kw_only=True)
class Hung(AttemptEnd):
    """The heartbeat did not advance within the timeout; the supervisor stopped the group."""

    reason: ClassVar[str] = "hang"
    age_s: float
    """Seconds since the last advance when the hang was seen."""
    timeout_s: float
    """The timeout that applied (startup, restart, checkpoint, fixed or learned)."""
    phase: str = "train"
    """The hang clock's phase: "startup", "restart" (a re-start beyond its learned bound),
    "checkpoint" or "train"."""


@dataclass(frozen=True, kw_only=True)
class Ordered(AttemptEnd):
    """The job asked this node to stop: a restart elsewhere, a lost node, or the end."""

    reason: ClassVar[str] = "peer"
    order: JobRestarted | NodesLost | JobEnded


Outcome = Exited | Hung | Ordered
"""How an attempt ended (``Supervisor.history`` holds one per attempt)."""
