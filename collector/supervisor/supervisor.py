"""The supervisor: run a training launcher, restart it when it crashes or hangs.

    torchvitals supervise --checkpoint-dir ckpt --hang-timeout-s 120 -- torchrun ... train.py

The launcher runs in its own process group with ``TORCHVITALS_HEARTBEAT_DIR`` set to a fresh
folder per attempt, where every rank's agent keeps ``heartbeat-rank<r>.json`` (the format: ``torchvitals.protocol``).
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

from ...agent.recover.ledger import Ledger, LedgerError
from ...protocol import ATTEMPT_ENV, HEARTBEAT_DIR_ENV, LEDGER_FILE, Beat, read_heartbeats
from .config import SupervisorConfig
from .metrics import SupervisorMetrics
from .process import stop_group

log = logging.getLogger("torchvitals.supervisor")


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
            stop_group(self._proc, self.config.grace_s, _pids(folder))

    def _run_attempt(self, folder: Path) -> tuple[str, int]:
        """One run of the command. Returns ("exit", status) or ("hang", status after the stop)."""
        folder.mkdir(parents=True, exist_ok=True)
        env = {**self._environ, HEARTBEAT_DIR_ENV: str(folder), ATTEMPT_ENV: str(self.attempt)}
        log.info("torchvitals supervise: attempt %d: %s", self.attempt, " ".join(self.command))
        started = time.time()
        self._proc = proc = subprocess.Popen(self.command, env=env, start_new_session=True)
        hang = HangClock(self.config, self.intervals, self._clock())
        while True:
            status = proc.poll()
            if status is not None:
                self.history.append(Attempt(self.attempt, started, time.time(), "exit", status))
                # Ranks the launcher left behind would hold ports and files of the next attempt.
                stop_group(proc, self.config.grace_s, _pids(folder))
                return "exit", status
            now = self._clock()
            hang.observe(read_heartbeats(folder), now)
            self.metrics.heartbeat_age.set(hang.age(now))
            if hang.hung(now):
                log.warning("torchvitals supervise: no heartbeat advance for %.1f s (timeout "
                            "%.1f s, last %s); stopping the job", hang.age(now), hang.timeout(),
                            hang.beat)
                ended = time.time()
                status = stop_group(proc, self.config.grace_s, _pids(folder))
                self.history.append(Attempt(self.attempt, started, ended, "hang", status))
                return "hang", status
            self._sleep(self.config.poll_s)

    def _progress(self, folder: Path) -> int | None:
        """The last healthy step (the ledger's), or the attempt's highest heartbeat step."""
        if self.config.checkpoint_dir is None:
            beat = read_heartbeats(folder)
            return None if beat is None else beat.step
        try:
            entry = Ledger(Path(self.config.checkpoint_dir) / LEDGER_FILE, writer=False).load() \
                .last_checkpoint
        except LedgerError as exc:
            log.error("torchvitals supervise: %s", exc)
            return None
        return None if entry is None else int(entry["step"])


def _pids(folder: Path) -> tuple[int, ...]:
    """The pids the ranks wrote into their heartbeat files (torchrun's workers live outside the
    launcher's process group)."""
    beat = read_heartbeats(folder)
    return () if beat is None else beat.pids


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
