"""What a job's supervisors keep in its store: the keys, and the typed record under each.

    <KEY_ROOT><job>/attempt          JobAttempt  the job's attempt and the restart policy's state
    <KEY_ROOT><job>/final            JobFinal    the end of the job for good, which every node obeys
    <KEY_ROOT><job>/nodes/<rank>     NodeState   one node's supervisor: host, pid, attempt, state
    <KEY_ROOT><job>/incidents/a<attempt>/<incident key>   Verdict: who gathers the findings, then
                                                          what they decided (the ask, too)
    <KEY_ROOT><job>/reports/a<attempt>/<incident key>/<rank>   one node's findings (rank_findings)
    <KEY_ROOT><job>/rank_deaths/<rank>/a<attempt>/<pid>        a rank died: seen now (its revision)
    <KEY_ROOT><job>/ready/a<attempt>/<rank>                    a node at the attempt's start barrier

The keys every running node follows (``job_view``) sort before ``nodes/``: ``attempt``, ``final``,
``incidents/``; the nodes' findings and deaths sort after it, where only the node that gathers
an incident's findings looks (at that incident's reports alone), and ``ready/``, which the nodes
at a start barrier count (the store sends the number, not the keys).

Each record is a frozen dataclass written as JSON; ``*_json`` and ``*_of`` turn one into the
other, so the key layout and the field names live here once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

KEY_ROOT = "torchvitals/jobs/"
"""Every key of a job lives under ``KEY_ROOT + <job id> + "/"``."""

WAITING, RUNNING, DONE = "waiting", "running", "done"
"""A node's state: at the start barrier of an attempt; running it; its launcher exited 0."""


@dataclass(frozen=True)
class JobAttempt:
    """The job's attempt and the restart policy's state, the same on every node."""

    number: int = 1
    restarts: int = 0
    """Restarts of the job so far (any node's)."""
    best: int | None = None
    """The highest last healthy step seen at the end of an attempt."""
    stalled: int = 0
    """Restarts in a row that did not move ``best``."""
    reason: str = ""
    """Why this attempt was started (a person reads it)."""
    revision: int = field(default=0, compare=False)
    """The store's revision of the record (for the compare-and-swap); 0 in memory."""


def attempt_json(record: JobAttempt) -> str:
    """``record`` as the ``attempt`` key holds it (the revision is the store's, not written)."""
    data = asdict(record)
    data.pop("revision")
    return json.dumps(data)


def attempt_of(value: str, revision: int) -> JobAttempt:
    """The ``attempt`` key's value, read back at the store's ``revision``."""
    data = json.loads(value)
    return JobAttempt(
        number=int(data["number"]),
        restarts=int(data["restarts"]),
        best=data.get("best"),
        stalled=int(data["stalled"]),
        reason=str(data.get("reason", "")),
        revision=revision,
    )


@dataclass(frozen=True)
class JobFinal:
    """The end of the job for good: an abort, a refused folder, a restart policy that gave up,
    a lost node never replaced. The first node to write it wins."""

    code: int
    """The exit status every node ends with."""
    reason: str
    """Why (a person reads it)."""
    node: int
    """The node rank that ended the job."""
    attempt: int
    """The job's attempt when it ended: a later attempt (a requeue) is not ended by it."""


def final_json(final: JobFinal) -> str:
    return json.dumps(
        {"code": final.code, "reason": final.reason, "node": final.node, "attempt": final.attempt}
    )


def final_of(value: str) -> JobFinal:
    data: dict[str, Any] = json.loads(value)
    return JobFinal(
        code=int(data["code"]),
        reason=str(data["reason"]),
        node=int(data.get("node", -1)),
        attempt=int(data["attempt"]),
    )


@dataclass(frozen=True)
class NodeState:
    """What one node's supervisor publishes."""

    node: int
    host: str
    pid: int
    attempt: int
    state: str
    step: int = 0
    """The highest heartbeat step of its ranks in this attempt."""

    def name(self) -> str:
        return f"node {self.node} (host {self.host}, supervisor pid {self.pid})"


def node_key(node: int) -> str:
    """The key of node rank ``node``'s record, under the job's prefix."""
    return f"nodes/{node:05d}"


def reports_prefix(attempt: int, key: str) -> str:
    """Where every node's findings for incident ``key`` of ``attempt`` are published (one
    range: the gathering node follows it alone)."""
    return f"reports/a{attempt:04d}/{key}/"


def findings_key(node: int, attempt: int, key: str) -> str:
    """Where node ``node`` publishes its findings for incident ``key`` of ``attempt``."""
    return f"{reports_prefix(attempt, key)}{node:05d}"


def incident_prefix(attempt: int) -> str:
    """The incidents of ``attempt`` being decided or decided (``Verdict`` under each)."""
    return f"incidents/a{attempt:04d}/"


def verdict_key(attempt: int, key: str) -> str:
    """Where the node that gathers incident ``key``'s findings says so, then its verdict."""
    return f"{incident_prefix(attempt)}{key}"


def deaths_prefix(node: int) -> str:
    """Node ``node``'s records of its ranks' deaths, of every attempt."""
    return f"rank_deaths/{node:05d}/"


def death_key(node: int, attempt: int, pid: int) -> str:
    """Where node ``node`` records the death of its rank ``pid`` in ``attempt``: the store's
    revision of that write orders the deaths of every node (``death_marks``)."""
    return f"{deaths_prefix(node)}a{attempt:04d}/{pid}"


def ready_prefix(attempt: int) -> str:
    """The nodes at the start barrier of ``attempt`` (or past it, running it)."""
    return f"ready/a{attempt:04d}/"


def ready_key(node: int, attempt: int) -> str:
    """Node ``node`` is at the start barrier of ``attempt`` (or past it, running it)."""
    return f"{ready_prefix(attempt)}{node:05d}"


def report_of(name: str) -> tuple[int, str, int] | None:
    """(attempt, incident key, node) of a ``reports/`` key (its part after the job's prefix),
    or None for a key of another shape."""
    parts = name.split("/")
    if len(parts) != 4 or parts[0] != "reports" or not parts[1][1:].isdigit():
        return None
    if not parts[3].isdigit():
        return None
    return int(parts[1][1:]), parts[2], int(parts[3])


@dataclass(frozen=True)
class Verdict:
    """An incident being decided: the node gathering its findings, then the incidents it
    decided on (as their records hold them). The first node to claim the key gathers; the
    others wait for ``incidents``."""

    node: int
    """The node that gathers the findings and decides."""
    incidents: tuple[dict[str, Any], ...] | None = None
    """The records decided on (``Incident.to_dict``); None while the node gathers."""


def verdict_json(verdict: Verdict) -> str:
    data: dict[str, Any] = {"node": verdict.node}
    if verdict.incidents is not None:
        data["incidents"] = list(verdict.incidents)
    return json.dumps(data)


def verdict_of(value: str) -> Verdict | None:
    """A ``Verdict``, or None for a value that does not parse (never a verdict)."""
    try:
        data = json.loads(value)
        incidents = data.get("incidents")
        if incidents is not None and not (
            isinstance(incidents, list) and all(isinstance(i, dict) for i in incidents)
        ):
            return None
        return Verdict(int(data["node"]), None if incidents is None else tuple(incidents))
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def node_json(state: NodeState) -> str:
    return json.dumps(asdict(state))


def node_of(value: str) -> NodeState | None:
    """A node's record, or None for one that does not parse (never a node)."""
    try:
        return NodeState(**json.loads(value))
    except (TypeError, ValueError):
        return None
