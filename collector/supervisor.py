"""The supervisor: run a training launcher, restart it when it crashes or hangs.

    torchvitals supervise --checkpoint-dir ckpt --hang-timeout-s 120 -- torchrun ... train.py

The launcher runs in its own process group with ``TORCHVITALS_HEARTBEAT_DIR`` set to a fresh
folder per attempt, where every rank's agent keeps ``heartbeat-rank<r>.json`` (agent/heartbeat.py).
The supervisor only reads those files, so a hang is seen even when a rank is SIGSTOPped or holds
its GIL. An attempt ends when the launcher exits, or when the heartbeat (the highest step over
the ranks, and the newest write) has not advanced within the timeout: ``startup_timeout_s``
before the first heartbeat, ``checkpoint_timeout_s`` while a rank is in a checkpoint, else
``hang_timeout_s`` (or one learned from the observed intervals). The whole group is then stopped
(SIGTERM, SIGKILL after ``grace_s``) and the same command restarted after a back-off; the job
resumes itself through the watchdog's ledger. Exit status: 0 when the job exits 0,
``abort_exit_code`` (75) when the job aborted on purpose (the agent's loop guard or a collector's
abort order, told by the heartbeat's "aborted" phase: never restarted), ``no_progress_exit_code``
(76) when ``no_progress_restarts`` restarts in a row failed without advancing the last healthy
step, ``budget_exit_code`` (77) when ``max_restarts`` restarts are spent.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .config import SupervisorConfig
from .metrics import SupervisorMetrics

log = logging.getLogger("torchvitals.supervisor")

HEARTBEAT_ENV = "TORCHVITALS_HEARTBEAT_DIR"
ATTEMPT_ENV = "TORCHVITALS_SUPERVISOR_ATTEMPT"


@dataclass(frozen=True)
class Beat:
    """What the heartbeat files of one attempt say at one moment."""

    step: int
    """The highest step over the ranks."""
    time: float
    """The newest write (wall clock of the writing rank)."""
    checkpointing: bool
    """Whether any rank is in the "checkpoint" phase."""
    aborted: bool = False
    """Whether any rank aborted on purpose (the loop guard, or the collector's abort order)."""


def read_heartbeats(folder: str | os.PathLike) -> Beat | None:
    """Read every rank's heartbeat file in ``folder``.

    Returns:
        The combined beat, or None when no file is readable yet. A file caught mid-replace
        cannot happen (the agent renames), but one that does not parse is skipped.
    """
    beats = []
    for path in Path(folder).glob("heartbeat-rank*.json"):
        try:
            beats.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    if not beats:
        return None
    return Beat(step=max(int(b["step"]) for b in beats), time=max(float(b["time"]) for b in beats),
                checkpointing=any(b.get("phase") == "checkpoint" for b in beats),
                aborted=any(b.get("phase") == "aborted" for b in beats))


@dataclass(frozen=True)
class Attempt:
    """How one run of the command ended."""

    number: int
    started: float
    """Wall-clock start."""
    ended: float
    """Wall-clock time the exit or the hang was seen (before the group was stopped)."""
    reason: str
    """"exit" or "hang"."""
    status: int
    """The launcher's exit status (negative: the signal that ended it)."""


def heartbeat_pids(folder: str | os.PathLike) -> list[int]:
    """The pids the ranks wrote into their heartbeat files."""
    pids = []
    for path in Path(folder).glob("heartbeat-rank*.json"):
        try:
            pids.append(int(json.loads(path.read_text(encoding="utf-8"))["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return pids


class HangClock:
    """Decides whether an attempt hangs, from the beats it is shown over time.

    Args:
        config: the timeouts.
        intervals: observed seconds between advances, shared across attempts so a restarted
            job keeps the learned timeout.
    """

    def __init__(self, config: SupervisorConfig, intervals: deque[float], now: float) -> None:
        self.config, self.intervals = config, intervals
        self.started = self.advanced = now
        self.beat: Beat | None = None

    def observe(self, beat: Beat | None, now: float) -> None:
        if beat is None or beat == self.beat:
            return
        if self.beat is not None and beat.step > self.beat.step:
            self.intervals.append(now - self.advanced)
        self.beat, self.advanced = beat, now

    def age(self, now: float) -> float:
        """Seconds since the last advance (since the start before the first beat)."""
        return now - self.advanced

    def timeout(self) -> float:
        if self.beat is None:
            return self.config.startup_timeout_s
        if self.beat.checkpointing:
            return self.config.checkpoint_timeout_s
        if self.config.hang_timeout_s is not None:
            return self.config.hang_timeout_s
        if not self.intervals:
            return self.config.hang_floor_s
        return max(self.config.hang_floor_s,
                   self.config.hang_factor * statistics.median(self.intervals))

    def hung(self, now: float) -> bool:
        return self.age(now) > self.timeout()


def stop_group(proc: subprocess.Popen, grace_s: float, pids: Sequence[int] = (),
               poll_s: float = 0.05) -> int:
    """Stop the job: the process group led by ``proc``, every descendant of ``proc`` and
    ``pids`` (the ranks' heartbeat pids: torchrun starts each worker in a session of its own,
    outside the launcher's group). SIGTERM (and SIGCONT, so a stopped rank can act on it), then
    SIGKILL to whatever is left after ``grace_s``.

    Returns:
        The leader's exit status.
    """
    pgid = proc.pid
    targets = (_descendants(proc.pid) | set(pids)) - {os.getpid()}
    for sig in (signal.SIGTERM, signal.SIGCONT):
        _killpg(pgid, sig)
        for pid in targets:
            _kill(pid, sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (_group_alive(pgid) or any(map(_running, targets))):
        proc.poll()             # reap the leader, or it stays in the group as a zombie
        time.sleep(poll_s)
    _killpg(pgid, signal.SIGKILL)
    for pid in targets:
        if _running(pid):
            _kill(pid, signal.SIGKILL)
    return proc.wait()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _proc_stats() -> dict[int, list[str]]:
    """pid -> the /proc/<pid>/stat fields after the command name (state, ppid, pgrp, ...)."""
    stats = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats[int(path.parent.name)] = path.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError, ValueError):
            continue
    return stats


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, fields in _proc_stats().items():
        children.setdefault(int(fields[1]), []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no port or file)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: orphaned ranks are
    reaped by init, which can take seconds."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not Path("/proc").is_dir():
        return True
    return any(int(f[2]) == pgid and f[0] != "Z" for f in _proc_stats().values())


class Supervisor:
    """Runs ``command`` until it exits 0 or the restart policy gives up.

    Args:
        config: the policy and timeouts.
        command: the launcher and its arguments.
        metrics: where restarts, attempt and heartbeat age are recorded.
        clock: monotonic seconds.
        sleep: waits between polls and for the back-off.
        environ: the job's base environment (default ``os.environ``).
    """

    def __init__(self, config: SupervisorConfig, command: Sequence[str], *,
                 metrics: SupervisorMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 environ: dict[str, str] | None = None) -> None:
        if not command:
            raise ValueError("no command to supervise (put it after --)")
        self.config, self.command = config, list(command)
        self.metrics = SupervisorMetrics() if metrics is None else metrics
        self._clock, self._sleep = clock, sleep
        self._environ = dict(os.environ if environ is None else environ)
        root = config.heartbeat_root or tempfile.mkdtemp(prefix="torchvitals-supervise-")
        self.root = Path(root)
        self.intervals: deque[float] = deque(maxlen=1000)
        self.attempt = 0
        self.restarts = 0
        self.history: list[Attempt] = []
        """Every attempt so far, oldest first."""
        self._proc: subprocess.Popen | None = None

    def run(self) -> int:
        """Supervise until the job succeeds or the policy gives up; returns the exit status."""
        best: int | None = None
        stalled = 0
        while True:
            self.attempt += 1
            self.metrics.attempt.set(self.attempt)
            folder = self.root / f"attempt-{self.attempt:04d}"
            reason, status = self._run_attempt(folder)
            if reason == "exit" and status == 0:
                log.info("torchvitals supervise: the job finished (attempt %d)", self.attempt)
                return 0
            beat = read_heartbeats(folder)
            if beat is not None and beat.aborted:
                # A restart would undo the decision: the loop guard found rollbacks not curing
                # the run, or the collector ordered it stopped. A person decides what is next.
                log.error("torchvitals supervise: the job aborted itself (attempt %d, status %s, "
                          "step %d): not restarting", self.attempt, status, beat.step)
                return self.config.abort_exit_code
            reason = "hang" if reason == "hang" else "crash"
            progress = self._progress(folder)
            if progress is not None and (best is None or progress > best):
                best, stalled = progress, 0
            elif self.attempt > 1:
                stalled += 1        # a restart that did not move the last healthy step
            log.warning("torchvitals supervise: attempt %d ended by %s (status %s); last healthy "
                        "step %s", self.attempt, reason, status, progress)
            if stalled >= self.config.no_progress_restarts:
                log.error("torchvitals supervise: %d restarts in a row without progress past step "
                          "%s; giving up", stalled, best)
                return self.config.no_progress_exit_code
            if self.restarts >= self.config.max_restarts:
                log.error("torchvitals supervise: restart budget (%d) spent; giving up",
                          self.config.max_restarts)
                return self.config.budget_exit_code
            self.restarts += 1
            self.metrics.restarts.labels(reason).inc()
            # Progress resets the back-off: a job that fails rarely restarts quickly.
            self._sleep(min(self.config.backoff_max_s,
                            self.config.backoff_s * 2 ** stalled))

    def stop(self) -> None:
        """Stop the running attempt's process group (a signal to the supervisor itself)."""
        if self._proc is not None and self._proc.poll() is None:
            folder = self.root / f"attempt-{self.attempt:04d}"
            stop_group(self._proc, self.config.grace_s, heartbeat_pids(folder))

    def _run_attempt(self, folder: Path) -> tuple[str, int]:
        """One run of the command. Returns ("exit", status) or ("hang", status after the stop)."""
        folder.mkdir(parents=True, exist_ok=True)
        env = {**self._environ, HEARTBEAT_ENV: str(folder), ATTEMPT_ENV: str(self.attempt)}
        log.info("torchvitals supervise: attempt %d: %s", self.attempt, " ".join(self.command))
        started = time.time()
        self._proc = proc = subprocess.Popen(self.command, env=env, start_new_session=True)
        hang = HangClock(self.config, self.intervals, self._clock())
        while True:
            status = proc.poll()
            if status is not None:
                self.history.append(Attempt(self.attempt, started, time.time(), "exit", status))
                # Ranks the launcher left behind would hold ports and files of the next attempt.
                stop_group(proc, self.config.grace_s, heartbeat_pids(folder))
                return "exit", status
            now = self._clock()
            hang.observe(read_heartbeats(folder), now)
            self.metrics.heartbeat_age.set(hang.age(now))
            if hang.hung(now):
                log.warning("torchvitals supervise: no heartbeat advance for %.1f s (timeout "
                            "%.1f s, last %s); stopping the job", hang.age(now), hang.timeout(),
                            hang.beat)
                ended = time.time()
                status = stop_group(proc, self.config.grace_s, heartbeat_pids(folder))
                self.history.append(Attempt(self.attempt, started, ended, "hang", status))
                return "hang", status
            self._sleep(self.config.poll_s)

    def _progress(self, folder: Path) -> int | None:
        """The last healthy step (the ledger's), or the attempt's highest heartbeat step."""
        if self.config.checkpoint_dir is None:
            beat = read_heartbeats(folder)
            return None if beat is None else beat.step
        from ..agent.ledger import Ledger, LedgerError
        try:
            entry = Ledger(Path(self.config.checkpoint_dir) / "ledger.json", writer=False).load() \
                .last_checkpoint
        except LedgerError as exc:
            log.error("torchvitals supervise: %s", exc)
            return None
        return None if entry is None else int(entry["step"])


def supervise(config: SupervisorConfig, command: Sequence[str]) -> int:
    """Run ``command`` under ``config``, with /metrics when configured and SIGTERM/SIGINT
    passed on to the job's process group.

    Returns:
        The exit status (0, ``no_progress_exit_code``, ``budget_exit_code``, or 128 + the
        signal that stopped the supervisor).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    supervisor = Supervisor(config, command)
    if config.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(config.metrics_port, addr="127.0.0.1",
                          registry=supervisor.metrics.registry)

    class _Stopped(Exception):
        pass

    def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        raise _Stopped(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return supervisor.run()
    except _Stopped as stopped:
        log.warning("torchvitals supervise: signal %d; stopping the job", stopped.args[0])
        supervisor.stop()
        return 128 + stopped.args[0]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
