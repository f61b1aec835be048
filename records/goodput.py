"""Goodput: the job's productive time over its wall time, across every attempt, and the rest
(badput) by cause.

    torchvitals goodput ckpt/ [--json]

The records it reads are ``timeline``'s (``<job folder>/goodput/``: rank 0's steps, the
supervisors' attempts).

How the records become seconds (the rules ``account`` applies):

- The wall clock runs from the job's first record (the earliest supervisor wait or attempt
  start, or the first process's start, less the checkpoint load it reports) to its last (the
  last supervisor attempt end or end line, or the last step's end, whichever is later). Node
  0's supervisor file is the job's clock of attempts (every node writes the same attempts);
  another node's when node 0 wrote none.
- A step line covers [t - d, t]: its ``w`` is data_wait, its ``c`` checkpoint (both clamped
  into d), and the rest is productive when its step number is above the job's high-water mark
  (the highest step completed before it, across every attempt and process, in time order),
  else lost_progress: work done again after a rollback or a crash. A rollback line's rest is
  lost_progress too (its ``c`` is the restore) and does not raise the mark. A skipped step's
  rest (``x`` skip: a non-finite step, a one-step outlier whose update every rank dropped) is
  skipped_update; it raises the mark. A step's ``r`` (a suspect step computed once more) is
  rerun, clamped into d after ``c``. Each line only
  adds seconds, so the figures only grow while a job runs: they can be live counters.
- A process's start line: the ``load`` seconds before it are checkpoint. Steps of one process
  that overlap (rounding) are clipped to the previous step's end; a gap between them is
  unattributed.
- Per attempt: the supervisor's wait [t0, t1] is peers; [attempt start, first process start]
  is startup. Between two processes of one attempt (torchrun restarted its workers), the old
  one's last step end to the new one's start is restart, the new one's own startup included
  (a restart's startup is the restart's cost). A failed attempt: its last step end (its last
  process's start without steps) to the supervisor's ``detected`` is detection, ``detected``
  to the attempt's end is restart; an attempt that failed before any process started spent
  its time to ``detected`` in startup. A successful attempt's last step end to its end is
  teardown; so are, once the supervisor wrote its end line, the failed last attempt's
  ``detected`` to its end, and the last attempt's end to the end line. Between an attempt's
  end and the next wait (or the next attempt's start) is restart; without supervisors,
  between one process's last step and the next process's start.
- Whatever none of the above covers is unattributed: gaps, and time that two of them claim
  (each claim's overlap moves there), so productive + sum(badput) == wall exactly (every sum
  is taken in whole microseconds).
- An incident's lost seconds are its record's; a record without them gets what the accounting
  finds: the badput from the fault (a failed attempt's last step, a rollback, a restart of the
  workers) until a step is productive again, matched to the record by attempt, kind and time.
- A last line cut short by a crash is dropped silently (a line is read once it is whole); any
  other line that is not a record, or whose values make no sense (not finite, a negative
  duration, an end before its start), is named in ``problems`` and skipped.

Torch-free: the agent, the supervisor and the command line all import it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TorchvitalsError
from .incidents import IncidentLog
from .schema import (
    ACTION,
    ATTEMPT,
    BEGAN,
    CHECKPOINT,
    DATA_WAIT,
    ENDED,
    EVENT,
    RERUN,
    SCHEMA_VERSION,
    SECONDS,
    STEP,
    TIME,
    VERSION,
    check_version,
)
from .timeline import FOLDER, STEPS_GLOB, SUPERVISOR_GLOB
from .vocabulary import FAULT_KINDS, ROLLBACK_KINDS, Action

__all__ = ["CAUSES", "FOLDER", "Accountant", "Goodput", "GoodputError", "IncidentCost", "account"]

log = logging.getLogger("torchvitals.goodput")

CAUSES = (
    "startup",
    "checkpoint",
    "detection",
    "restart",
    "lost_progress",
    "skipped_update",
    "rerun",
    "data_wait",
    "peers",
    "teardown",
    "unattributed",
)
"""Every cause of badput (the ``cause`` label of the badput counter), in the order shown."""

_US = 1_000_000
_PRODUCTIVE = "productive"
_MATCH_SLACK_US = 120 * _US
"""How far before a disruption an incident's detection may lie and still be its cause."""
_STEPS_NAME = re.compile(r"^steps-a(\d+)-p(\d+)\.jsonl$")
_SUPERVISOR_NAME = re.compile(r"^supervisor-node(\d+)\.jsonl$")


class GoodputError(TorchvitalsError, ValueError):
    """The folder holds no goodput records (the message names it)."""


@dataclass(frozen=True, kw_only=True)
class IncidentCost:
    """One incident and the wall time it cost the job."""

    key: str
    kind: str
    lost_seconds: float | None
    """From the incident's record, else from the accounting (None: it found no disruption)."""


@dataclass(frozen=True, kw_only=True)
class Goodput:
    """The job's wall time split into productive time and badput by cause."""

    folder: str
    wall_seconds: float
    productive_seconds: float
    goodput: float
    """productive over wall (0 for an empty wall)."""
    badput: dict[str, float]
    """Seconds by cause, every one of ``CAUSES``; with productive, they add up to the wall."""
    incidents: tuple[IncidentCost, ...]
    attempts: int
    """Attempts seen (the supervisor's, or distinct attempt numbers of the step files)."""
    processes: int
    """Global rank 0's processes (one step file each)."""
    steps: int
    """Step lines read, redone steps included, rollbacks not."""
    last_step: int
    """The high-water mark: the highest step completed."""
    started_at: float
    ended_at: float
    problems: tuple[str, ...]
    """One line per record or file that could not be read (file and line named)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_seconds": self.wall_seconds,
            "productive_seconds": self.productive_seconds,
            "goodput": self.goodput,
            "badput": dict(self.badput),
            "incidents": [
                {"key": i.key, "kind": i.kind, "lost_seconds": i.lost_seconds}
                for i in self.incidents
            ],
            "attempts": self.attempts,
            "processes": self.processes,
            "steps": self.steps,
            "last_step": self.last_step,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "problems": list(self.problems),
        }

    def render(self) -> str:
        """The table ``torchvitals goodput`` prints."""
        wall = self.wall_seconds
        lines = [
            f"goodput {self.goodput:.3f}: {self.productive_seconds:.1f} s productive of "
            f"{wall:.1f} s wall ({self.attempts} attempt(s), {self.processes} process(es), "
            f"{self.steps} steps to step {self.last_step})",
            f"  {'badput':<14}{'seconds':>10}{'share':>8}",
        ]
        for cause in CAUSES:
            share = self.badput[cause] / wall if wall > 0 else 0.0
            lines.append(f"  {cause:<14}{self.badput[cause]:>10.1f}{share:>8.1%}")
        total = sum(self.badput.values())
        lines.append(f"  {'total':<14}{total:>10.1f}{(total / wall if wall else 0.0):>8.1%}")
        if self.incidents:
            lines.append(f"  {'incident':<40}{'lost s':>10}")
            for i in self.incidents:
                lost = "?" if i.lost_seconds is None else f"{i.lost_seconds:.1f}"
                lines.append(f"  {i.key:<40}{lost:>10}")
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)


def account(folder: str | os.PathLike) -> Goodput:
    """The goodput of the job whose folder is ``folder`` (its ``goodput/`` records).

    Raises:
        GoodputError: no record in ``<folder>/goodput`` (the error names it).
    """
    return Accountant(folder).account()


def _us(seconds: float) -> int:
    return round(seconds * _US)


def _seconds(us: int) -> float:
    return us / _US


@dataclass
class _Disruption:
    """A fault's cost, counted from the fault until a step is productive again."""

    kind: str  # "attempt" (a failed attempt), "restart" (workers restarted), "rollback"
    attempt: int | None
    at: int
    lost: int = 0


class _Steps:
    """One step file, folded line by line into seconds by cause; it reads on from where it
    stopped when the file grew (a live job's process), from scratch when what it started from
    (the high-water mark before it) changed."""

    def __init__(self, path: Path, attempt: int, pid: int) -> None:
        self.path, self.attempt, self.pid = path, attempt, pid
        self._reset(None)

    def _reset(self, hwm_in: int | None) -> None:
        self.hwm_in = hwm_in
        self.hwm = -1 if hwm_in is None else hwm_in
        self.offset = self.line_no = 0
        self.identity: tuple[int, int] | None = None
        self.start: int | None = None
        self.begin: int | None = None
        self.end: int | None = None
        self.parts: dict[str, int] = dict.fromkeys((_PRODUCTIVE, *CAUSES), 0)
        self.steps = 0
        self.productive_seen = False
        self.head_lost = 0
        """Non-productive microseconds from this process's start to its first productive step."""
        self.rollbacks: list[_Disruption] = []
        self._open: _Disruption | None = None
        """The rollback whose cost is still being counted (until a step is new again)."""
        self.problems: list[str] = []

    def first_time(self) -> float | None:
        """When this process began, from its first line (orders the processes)."""
        try:
            with open(self.path, "rb") as f:
                line = f.readline()
        except OSError:
            return None
        if not line.endswith(b"\n"):
            return None
        try:
            record = json.loads(line)
            if record.get(EVENT) == "start":
                at = float(record[TIME]) - float(record.get("load", 0.0))
            else:
                at = float(record[TIME]) - float(record.get(SECONDS, 0.0))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        return at if math.isfinite(at) else None

    def fold(self, hwm_in: int) -> None:
        """Read the lines added since the last call, the high-water mark before this process
        being ``hwm_in``."""
        try:
            stat = self.path.stat()
        except OSError as exc:
            self._reset(hwm_in)
            self.problems.append(f"{self.path}: cannot read ({exc.strerror or exc})")
            return
        identity = (stat.st_dev, stat.st_ino)
        if hwm_in != self.hwm_in or identity != self.identity or stat.st_size < self.offset:
            self._reset(hwm_in)
            self.identity = identity
        if stat.st_size == self.offset:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(stat.st_size - self.offset)
        except OSError as exc:
            self.problems.append(f"{self.path}: cannot read ({exc.strerror or exc})")
            return
        whole = data.rfind(b"\n") + 1  # a line cut short stays unread until it is whole
        self.offset += whole
        for raw in data[:whole].decode("utf-8", errors="replace").split("\n")[:-1]:
            self.line_no += 1
            try:
                record = _parse(raw)
                if record.get(EVENT) == "step":
                    self._step(record)
                else:
                    self._line(record)
            except ValueError as exc:
                self.problems.append(f"{self.path}:{self.line_no}: {exc}")

    def _line(self, record: dict[str, Any]) -> None:
        kind = record.get(EVENT)
        if kind == "start":
            if self.begin is not None:
                raise ValueError("a start line after this process's first line")
            at, load = _time(record, TIME), _duration(record, "load", optional=True)
            self.start, self.begin, self.end = at, at - load, at
            self._add("checkpoint", load)
        else:
            raise ValueError(f"not a step file's record (e={kind!r:.40})")

    def _step(self, record: dict[str, Any]) -> None:
        # The hot loop of a long job's file (a million lines): one check per value here, the
        # words of what is wrong only for a line that fails it.
        step: Any = record.get(STEP)
        end: Any = record.get(TIME)
        d: Any = record.get(SECONDS)
        w: Any = record.get(DATA_WAIT) or 0
        c: Any = record.get(CHECKPOINT) or 0
        r: Any = record.get(RERUN) or 0
        action = record.get(ACTION)
        if not (
            type(step) is int
            and step >= 0
            and _fine(end)
            and _fine(d)
            and _fine(w)
            and _fine(c)
            and _fine(r)
            and (action is None or type(action) is str)
        ):
            _step_problem(record)
        end, d, w, c = round(end * _US), round(d * _US), round(w * _US), round(c * _US)
        r = round(r * _US)
        begin = end - d
        if self.end is None:
            self.begin = begin
        elif end < self.end:
            raise ValueError("ends before the previous line of this process")
        elif begin > self.end:
            self._add("unattributed", begin - self.end)
        else:
            d = end - self.end  # overlapping the previous step (rounding): clipped
        c = min(c, d)
        r = min(r, d - c)
        w = min(w, d - c - r)
        work = d - c - r - w
        rollback = action == Action.ROLLBACK
        skipped = action == Action.SKIP  # computed, then dropped on every rank: no progress
        productive = not rollback and not skipped and step > self.hwm
        if productive:
            self._open = None
            self.productive_seen = True
        elif rollback:  # a second rollback before the first recovered: a disruption of its own
            self._open = _Disruption("rollback", self.attempt, begin)
            self.rollbacks.append(self._open)
        parts = self.parts
        parts["data_wait"] += w
        parts["checkpoint"] += c
        parts["rerun"] += r
        parts[_PRODUCTIVE if productive else "skipped_update" if skipped else "lost_progress"] += (
            work
        )
        lost = w + c + r + (0 if productive else work)
        if not self.productive_seen:
            self.head_lost += lost
        if self._open is not None:
            self._open.lost += lost
        if not rollback:
            self.steps += 1
            if step > self.hwm:
                self.hwm = step
        self.end = end

    def _add(self, cause: str, us: int) -> None:
        """Badput outside a step's own parts (a checkpoint load, a gap between steps)."""
        self.parts[cause] += us
        if not self.productive_seen:
            self.head_lost += us
        if self._open is not None:
            self._open.lost += us


def _fine(value: Any) -> bool:
    """A finite, non-negative number (NaN fails both comparisons)."""
    return (type(value) is float or type(value) is int) and 0 <= value < math.inf


def _step_problem(record: dict[str, Any]) -> None:
    """Raise what is wrong with a step line that failed ``_fine``, naming the field."""
    step = record.get(STEP)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"s: expected a step number, got {step!r:.40}")
    _time(record, TIME)
    _duration(record, SECONDS)
    _duration(record, DATA_WAIT, optional=True)
    _duration(record, CHECKPOINT, optional=True)
    _duration(record, RERUN, optional=True)
    raise ValueError(f"x: expected a string, got {record.get('x')!r:.40}")


_DECODER = json.JSONDecoder()


def _parse(raw: str | bytes) -> dict[str, Any]:
    try:
        record = _DECODER.decode(raw) if isinstance(raw, str) else json.loads(raw)
    except ValueError:
        raise ValueError(f"not JSON: {raw[:60]!r}") from None
    if type(record) is not dict:
        raise ValueError("not a JSON object")
    version = record.get(VERSION, SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        check_version(version)  # a ValueError: the line is a problem named by its file
    return record


def _number(record: dict[str, Any], name: str) -> float:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: expected a number, got {value!r:.40}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: not finite ({value})")
    return float(value)


def _time(record: dict[str, Any], name: str) -> int:
    """Unix seconds, in microseconds."""
    value = _number(record, name)
    if value < 0:
        raise ValueError(f"{name}: a negative time ({value})")
    return _us(value)


def _duration(record: dict[str, Any], name: str, *, optional: bool = False) -> int:
    if optional and record.get(name) is None:
        return 0
    value = _number(record, name)
    if value < 0:
        raise ValueError(f"{name}: a negative duration ({value})")
    return _us(value)


@dataclass
class _Attempt:
    """One attempt on the job's clock, or (without supervisors) one attempt number's processes."""

    number: int
    wait: tuple[int, int] | None = None
    line: dict[str, Any] | None = None
    """The supervisor's attempt record (t0, t1, ok, detected in microseconds), None while it
    runs or without supervisors."""
    end: int | None = None
    """The supervisor's end line after this attempt (the job ended)."""
    procs: list[_Steps] = field(default_factory=list)

    def t0(self) -> int | None:
        if self.line is not None:
            return self.line[BEGAN]
        if self.wait is not None:
            return self.wait[1]
        return self.procs[0].begin if self.procs else None

    def first(self) -> int | None:
        return self.wait[0] if self.wait is not None else self.t0()


@dataclass
class _Piece:
    """A span of the wall clock and its seconds by cause (they add up to the span)."""

    start: int
    end: int
    parts: dict[str, int]
    opens: _Disruption | None = None
    proc: _Steps | None = None


class Accountant:
    """Computes ``account`` for one folder again and again, reading each step file on from
    where it stopped (the supervisor's exporter keeps one; ``account`` makes a fresh one)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.records = self.folder / FOLDER
        self._steps: dict[Path, _Steps] = {}

    def account(self) -> Goodput:
        """The job's goodput now.

        Raises:
            GoodputError: no record in the folder.
        """
        problems: list[str] = []
        procs = self._fold_steps(problems)
        clock = self._read_clock(problems)
        attempts = _attempts(clock, procs)
        pieces = _pieces(attempts)
        if not pieces:
            raise GoodputError(f"{self.records}: no goodput records (steps-*.jsonl, supervisor-*)")
        parts, disruptions, w0, w1 = _sweep(pieces)
        for p in procs:
            disruptions += p.rollbacks
        found, incident_problems = IncidentLog(self.folder).read()
        wall = w1 - w0
        assert sum(parts.values()) == wall, (parts, wall)  # the sweep's invariant
        return Goodput(
            folder=str(self.folder),
            wall_seconds=_seconds(wall),
            productive_seconds=_seconds(parts[_PRODUCTIVE]),
            goodput=parts[_PRODUCTIVE] / wall if wall > 0 else 0.0,
            badput={cause: _seconds(parts[cause]) for cause in CAUSES},
            incidents=_costs(found, disruptions),
            attempts=sum(1 for a in attempts if a.line is not None or a.procs),
            processes=sum(1 for p in procs if p.begin is not None),
            steps=sum(p.steps for p in procs),
            last_step=max((p.hwm for p in procs), default=-1),
            started_at=_seconds(w0),
            ended_at=_seconds(w1),
            problems=tuple(problems + incident_problems),
        )

    def _fold_steps(self, problems: list[str]) -> list[_Steps]:
        """Every step file, folded in the order the processes began (the high-water mark runs
        through them in time order)."""
        seen = {}
        for path in sorted(self.records.glob(STEPS_GLOB)) if self.records.is_dir() else []:
            match = _STEPS_NAME.match(path.name)
            if match is None:
                continue
            seen[path] = self._steps.get(path) or _Steps(
                path, int(match.group(1)), int(match.group(2))
            )
        self._steps = seen
        order = sorted(seen.values(), key=lambda s: (s.first_time() or math.inf, s.path.name))
        hwm = -1
        for steps in order:
            steps.fold(hwm)
            hwm = max(hwm, steps.hwm)
            problems += steps.problems
        return [s for s in order if s.begin is not None]

    def _read_clock(self, problems: list[str]) -> list[dict[str, Any]]:
        """Node 0's supervisor records (the job's attempts), else the lowest node's that wrote."""
        paths = []
        for path in self.records.glob(SUPERVISOR_GLOB) if self.records.is_dir() else []:
            match = _SUPERVISOR_NAME.match(path.name)
            if match is not None:
                paths.append((int(match.group(1)), path))
        for _, path in sorted(paths):
            records = _read_supervisor(path, problems)
            if records:
                return records
        return []


def _read_supervisor(path: Path, problems: list[str]) -> list[dict[str, Any]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        problems.append(f"{path}: cannot read ({exc.strerror or exc})")
        return []
    records = []
    for number, raw in enumerate(data[: data.rfind(b"\n") + 1].splitlines(), 1):
        try:
            records.append(_supervisor_record(_parse(raw)))
        except ValueError as exc:
            problems.append(f"{path}:{number}: {exc}")
    return records


def _supervisor_record(record: dict[str, Any]) -> dict[str, Any]:
    """A supervisor line, its times in microseconds, checked."""
    kind = record.get(EVENT)
    if kind == "end":
        return {EVENT: kind, TIME: _time(record, TIME)}
    if kind not in ("wait", "attempt"):
        raise ValueError(f"not a supervisor's record (e={kind!r:.40})")
    number = record.get(ATTEMPT)
    if not isinstance(number, int) or isinstance(number, bool):
        raise ValueError(f"a: expected an attempt number, got {number!r:.40}")
    t0, t1 = _time(record, BEGAN), _time(record, ENDED)
    if t1 < t0:
        raise ValueError(f"t1 before t0 ({t1 - t0} us)")
    out = {EVENT: kind, ATTEMPT: number, BEGAN: t0, ENDED: t1}
    if kind == "attempt":
        status = record.get("status")
        if not isinstance(status, int) or isinstance(status, bool):
            raise ValueError(f"status: expected an exit status, got {status!r:.40}")
        detected = _time(record, "detected") if record.get("detected") is not None else t1
        out["ok"] = record.get("reason") == "exit" and status == 0
        out["detected"] = min(max(detected, t0), t1)
    return out


def _attempts(clock: list[dict[str, Any]], procs: list[_Steps]) -> list[_Attempt]:
    """The job's attempts in time order, each with its wait, its record and its processes."""
    attempts: list[_Attempt] = []
    wait: dict[str, Any] | None = None
    for r in clock:
        if r[EVENT] == "wait":
            if wait is not None:  # waited again without starting: a wait of its own
                attempts.append(_Attempt(wait[ATTEMPT], wait=(wait[BEGAN], wait[ENDED])))
            wait = r
        elif r[EVENT] == "attempt":
            if wait is not None and wait[ATTEMPT] != r[ATTEMPT]:
                attempts.append(_Attempt(wait[ATTEMPT], wait=(wait[BEGAN], wait[ENDED])))
                wait = None
            attempts.append(
                _Attempt(
                    r[ATTEMPT], wait=None if wait is None else (wait[BEGAN], wait[ENDED]), line=r
                )
            )
            wait = None
        elif wait is not None:  # waited, then ended without starting
            attempts.append(_Attempt(wait[ATTEMPT], wait=(wait[BEGAN], wait[ENDED]), end=r[TIME]))
            wait = None
        elif attempts:
            attempts[-1].end = max(attempts[-1].end or 0, r[TIME])
    if wait is not None:  # the attempt running now
        attempts.append(_Attempt(wait[ATTEMPT], wait=(wait[BEGAN], wait[ENDED])))
    for p in procs:
        _attempt_of(p, attempts).procs.append(p)
    return sorted((a for a in attempts if a.first() is not None), key=lambda a: a.first() or 0)


def _attempt_of(proc: _Steps, attempts: list[_Attempt]) -> _Attempt:
    """The attempt of the same number whose span holds the process's start (a requeued job may
    number its attempts again), else the latest before it; a new one if there is none."""
    assert proc.begin is not None
    same = [a for a in attempts if a.number == proc.attempt]
    for a in same:
        t0 = a.t0()
        t1 = a.line[ENDED] if a.line is not None else math.inf
        if t0 is not None and t0 <= proc.begin <= t1:
            return a
    before = [a for a in same if (a.first() or 0) <= proc.begin]
    if before:
        return before[-1]
    if same:
        return same[0]
    attempts.append(_Attempt(proc.attempt))
    return attempts[-1]


def _span(cause: str, start: int, end: int, opens: _Disruption | None = None) -> _Piece:
    end = max(start, end)
    return _Piece(start, end, {cause: end - start}, opens=opens)


def _pieces(attempts: list[_Attempt]) -> list[_Piece]:
    """Each attempt's spans by the rules of the module's comment, in time order."""
    out: list[_Piece] = []
    last: int | None = None
    for i, a in enumerate(attempts):
        first = a.first()
        t0 = a.t0()
        assert first is not None and t0 is not None
        if last is not None:
            out.append(_span("restart", last, first))
            if a.line is None and a.wait is None and a.procs:  # unsupervised: a new process
                out[-1].opens = _Disruption("restart", a.number, last)
        if a.wait is not None:
            out.append(_span("peers", *a.wait))
        work_end = t0
        for j, p in enumerate(a.procs):
            assert p.begin is not None and p.end is not None
            if j == 0:
                out.append(_span("startup", t0, p.begin))
            else:
                out.append(
                    _span("restart", work_end, p.begin, _Disruption("restart", a.number, work_end))
                )
            out.append(_Piece(p.begin, p.end, dict(p.parts), proc=p))
            work_end = max(work_end, p.end)
        last = work_end
        if a.line is not None:
            t1, ended = a.line[ENDED], a.end is not None and i == len(attempts) - 1
            if a.line["ok"]:
                out.append(_span("teardown", work_end, t1))
            else:
                fault = _Disruption("attempt", a.number, work_end)
                detected = max(work_end, a.line["detected"])
                out.append(_span("detection" if a.procs else "startup", work_end, detected, fault))
                out.append(_span("teardown" if ended else "restart", detected, t1))
            last = max(work_end, t1)
        if a.end is not None:
            out.append(_span("teardown", last, a.end))
            last = max(last, a.end)
    return out


_TAKE_ORDER = ("unattributed", "checkpoint", "data_wait", "lost_progress", _PRODUCTIVE, *CAUSES)


def _take(parts: dict[str, int], us: int) -> int:
    """Remove ``us`` from ``parts`` (badput before productive time); returns what was taken."""
    taken = 0
    for cause in _TAKE_ORDER:
        step = min(parts.get(cause, 0), us - taken)
        if step > 0:
            parts[cause] -= step
            taken += step
    return taken


def _sweep(pieces: list[_Piece]) -> tuple[dict[str, int], list[_Disruption], int, int]:
    """The wall clock once over: each piece's seconds where it alone holds the time, gaps and
    overlaps unattributed, each disruption charged until a step is productive again.

    Returns:
        (seconds by cause and productive, the disruptions, wall start, wall end), microseconds.
    """
    order = sorted(range(len(pieces)), key=lambda i: (pieces[i].start, i))
    w0 = min(p.start for p in pieces)
    w1 = max(p.end for p in pieces)
    cursor, gaps = w0, 0
    credited: list[_Piece] = []
    disruptions: list[_Disruption] = []
    current: _Disruption | None = None
    for i in order:
        p = pieces[i]
        if p.opens is not None:  # a new fault: the one before it stops counting
            current = p.opens
            disruptions.append(current)
        if p.start > cursor:
            gaps += p.start - cursor
            if current is not None:
                current.lost += p.start - cursor
        elif p.start < cursor:
            overlap_end = min(p.end, cursor)
            _take(p.parts, overlap_end - p.start)  # that time is counted once, by earlier pieces
            for q in reversed(credited):  # where they overlap, it goes to unattributed
                shared = min(q.end, overlap_end) - max(q.start, p.start)
                if shared > 0:
                    q.parts["unattributed"] = q.parts.get("unattributed", 0) + _take(
                        q.parts, shared
                    )
        credited.append(p)
        if current is not None:
            if p.proc is None:
                current.lost += sum(v for k, v in p.parts.items() if k != _PRODUCTIVE)
            else:
                current.lost += min(
                    p.proc.head_lost, sum(p.parts.values()) - p.parts.get(_PRODUCTIVE, 0)
                )
                if p.proc.productive_seen:
                    current = None
        cursor = max(cursor, p.end)
    totals = dict.fromkeys((_PRODUCTIVE, *CAUSES), 0)
    totals["unattributed"] = gaps
    for p in credited:
        for cause, us in p.parts.items():
            totals[cause] += us
    return totals, disruptions, w0, w1


def _costs(found: list[Any], disruptions: list[_Disruption]) -> tuple[IncidentCost, ...]:
    """Each incident's lost seconds: its record's, else its disruption's (matched by attempt,
    kind and time, the nearest detection first; one incident per disruption)."""
    assigned: dict[str, int] = {}
    for d in sorted(disruptions, key=lambda d: d.at):
        kinds = ROLLBACK_KINDS if d.kind == "rollback" else FAULT_KINDS
        candidates = [
            i
            for i in found
            if i.kind in kinds
            and i.key not in assigned
            and (d.attempt is None or i.attempt is None or i.attempt == d.attempt)
            and _us(i.detected_at) >= d.at - _MATCH_SLACK_US
        ]
        if candidates:
            best = min(candidates, key=lambda i: abs(_us(i.detected_at) - d.at))
            assigned[best.key] = d.lost
    return tuple(
        IncidentCost(
            key=i.key,
            kind=i.kind,
            lost_seconds=i.lost_seconds
            if i.lost_seconds is not None
            else (_seconds(assigned[i.key]) if i.key in assigned else None),
        )
        for i in found
    )
