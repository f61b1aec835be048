"""The supervisor: run a training launcher, restart it when it crashes or hangs.

    torchvitals supervise --checkpoint-dir ckpt --hang-timeout-s 120 -- torchrun ... train.py

The launcher runs in its own process group with ``TORCHVITALS_HEARTBEAT_DIR`` set to a fresh
folder per attempt, where every rank's agent keeps ``heartbeat-rank<r>.json`` (the format: ``torchvitals.protocol``).
The supervisor only reads those files, so a hang is seen even when a rank is SIGSTOPped or holds
its GIL. An attempt ends when the launcher exits, or when the heartbeat (the highest step over
the ranks, and the newest write) has not advanced within the timeout: ``startup_timeout_s``
before the first heartbeat (and while no rank of the last one runs: torchrun restarting its
workers), ``checkpoint_timeout_s`` while a rank is in a checkpoint, else
``hang_timeout_s`` (or one learned from the observed intervals). The whole group is then stopped
(SIGTERM, SIGKILL after ``grace_s``) and the same command restarted after a back-off; the job
resumes itself through the watchdog's ledger, as the one job ``TORCHVITALS_JOB_ID`` names (set
for every attempt). The launcher dies with the supervisor (a parent-death signal). Exit status:
0 when the job exits 0,
``abort_exit_code`` (75) when the job aborted on purpose (the agent's loop guard or a collector's
abort order, told by the heartbeat's "aborted" phase: never restarted), ``no_progress_exit_code``
(76) when ``no_progress_restarts`` restarts in a row failed without advancing the last healthy
step, ``budget_exit_code`` (77) when ``max_restarts`` restarts are spent,
``refused_exit_code`` (78) when the job refused its checkpoint folder or found its ledger
corrupt (the "refused" phase: never retried), ``node_lost_exit_code`` (79) when a node was lost and not replaced.

With ``store_url``, the supervisors of the job's ``nnodes`` nodes agree through it (``peers``):
the attempt and the restart policy's state are the job's, not the node's, so a restart anywhere
stops and restarts every node's launcher together, and the end of the job is every node's.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from ...agent.recover.jobid import job_identity, launcher_job_id
from ...agent.recover.ledger import Ledger, LedgerError
from ...protocol import (
    ATTEMPT_ENV,
    HEARTBEAT_DIR_ENV,
    HEARTBEAT_GLOB,
    JOB_ID_ENV,
    LEDGER_FILE,
    Beat,
    read_heartbeats,
)
from .config import SupervisorConfig, node_rank
from .etcd import EtcdStore, StoreError, StoreTLS
from .metrics import SupervisorMetrics
from .peers import JobAttempt, Order, Peers, SoloPeers, StorePeers
from .process import die_with_parent, running, stop_group

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
    """"exit", "hang", or "peer" (the job restarted or ended on another node's word)."""
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
        self.between_workers = False
        """No rank of the last beat runs while the launcher does: torchrun is restarting its
        workers (an elastic restart, a rendezvous for peers), which is a start, not a hang."""

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
        if self.beat is None or self.between_workers:
            return self.config.startup_timeout_s
        if self.beat.checkpointing:
            return self.config.checkpoint_timeout_s
        if self.config.hang_timeout_s is not None:
            return self.config.hang_timeout_s
        if not self.intervals:
            return self.config.hang_floor_s
        return max(
            self.config.hang_floor_s, self.config.hang_factor * statistics.median(self.intervals)
        )

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
        peers: the other nodes' supervisors (default: none for one node, the store's for
            ``config.store_url``).
    """

    def __init__(
        self,
        config: SupervisorConfig,
        command: Sequence[str],
        *,
        metrics: SupervisorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        environ: dict[str, str] | None = None,
        peers: Peers | None = None,
    ) -> None:
        if not command:
            raise ValueError("no command to supervise (put it after --)")
        self.config, self.command = config, list(command)
        self.metrics = SupervisorMetrics() if metrics is None else metrics
        self._clock, self._sleep = clock, sleep
        self._environ = dict(os.environ if environ is None else environ)
        self.job_id = _job_id(config, self._environ, self.command)
        config = self.config = replace(config, node_rank=node_rank(config, self._environ))
        # Every attempt, on every node, is the same job: the ledger continues it after any
        # restart and refuses it to another job (torchvitals.agent.recover.jobid).
        self._environ[JOB_ID_ENV] = self.job_id
        if peers is None:
            peers = (
                StorePeers(
                    store_of(config), self.job_id, config, self.metrics, clock=clock, sleep=sleep
                )
                if config.store_url
                else SoloPeers()
            )
        self.peers = peers
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
        try:
            return self._run()
        finally:
            self.peers.close()

    def _run(self) -> int:
        record = self.peers.join()
        while True:
            go = self.peers.wait_for_peers(record.number)
            if go.final is not None:
                return go.final
            if go.attempt != record.number:
                record = self.peers.current()
            self.attempt = go.attempt or record.number
            self.restarts = record.restarts
            self.metrics.attempt.set(self.attempt)
            folder = self.root / f"attempt-{self.attempt:04d}"
            reason, status, order = self._run_attempt(folder)
            if order is not None:
                if order.final is not None:
                    return order.final
                if order.lost:
                    self.metrics.restarts.labels("lost").inc()
                    record = self.peers.restart(
                        JobAttempt(
                            number=self.attempt + 1,
                            restarts=record.restarts + 1,
                            best=record.best,
                            stalled=record.stalled,
                            reason=order.reason,
                        )
                    )
                else:
                    self.metrics.restarts.labels("peer").inc()
                    record = self.peers.current()
                continue
            if reason == "exit" and status == 0:
                log.info("torchvitals supervise: the job finished (attempt %d)", self.attempt)
                self.peers.done()
                return 0
            beat = read_heartbeats(folder)
            if beat is not None and beat.refused:
                # The folder is another job's (or a run this one was not told to continue): a
                # restart meets the same folder, and must never wear the refusal down.
                why = (
                    f"the job refused to resume its checkpoint folder (attempt {self.attempt}, "
                    f"status {status}); see the job's log for both job ids and the fix"
                )
                log.error("torchvitals supervise: %s: not restarting", why)
                return self.peers.finish(self.config.refused_exit_code, why)
            if beat is not None and beat.aborted:
                # A restart would undo the decision: the loop guard found rollbacks not curing
                # the run, or the collector ordered it stopped. A person decides what is next.
                why = (
                    f"the job aborted itself (attempt {self.attempt}, status {status}, "
                    f"step {beat.step})"
                )
                log.error("torchvitals supervise: %s: not restarting", why)
                return self.peers.finish(self.config.abort_exit_code, why)
            reason = "hang" if reason == "hang" else "crash"
            record = self.peers.current()
            if record.number != self.attempt:
                continue  # another node restarted the job meanwhile: follow it
            best, stalled = record.best, record.stalled
            progress = self._progress(folder)
            if progress is not None and (best is None or progress > best):
                best, stalled = progress, 0
            elif self.attempt > 1:
                stalled += 1  # a restart that did not move the last healthy step
            log.warning(
                "torchvitals supervise: attempt %d ended by %s (status %s); last healthy step %s",
                self.attempt,
                reason,
                status,
                progress,
            )
            if stalled >= self.config.no_progress_restarts:
                why = f"{stalled} restarts in a row without progress past step {best}"
                log.error("torchvitals supervise: %s; giving up", why)
                return self.peers.finish(self.config.no_progress_exit_code, why)
            if record.restarts >= self.config.max_restarts:
                why = f"restart budget ({self.config.max_restarts}) spent"
                log.error("torchvitals supervise: %s; giving up", why)
                return self.peers.finish(self.config.budget_exit_code, why)
            self.metrics.restarts.labels(reason).inc()
            # One new attempt for the job, which every node's supervisor follows at once.
            record = self.peers.restart(
                JobAttempt(
                    number=self.attempt + 1,
                    restarts=record.restarts + 1,
                    best=best,
                    stalled=stalled,
                    reason=f"node {self.config.node_rank}: attempt {self.attempt} ended by {reason}",
                )
            )
            self.restarts = record.restarts
            # Progress resets the back-off: a job that fails rarely restarts quickly.
            self._sleep(min(self.config.backoff_max_s, self.config.backoff_s * 2**stalled))

    def stop(self) -> None:
        """Stop the running attempt's process group (a signal to the supervisor itself)."""
        if self._proc is not None and self._proc.poll() is None:
            folder = self.root / f"attempt-{self.attempt:04d}"
            stop_group(self._proc, self.config.grace_s, _pids(folder))

    def _run_attempt(self, folder: Path) -> tuple[str, int, Order | None]:
        """One run of the command. Returns ("exit", status, None), ("hang", status after the
        stop, None), or ("peer", status after the stop, the job's order)."""
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(HEARTBEAT_GLOB):  # a requeued job may reuse the number
            stale.unlink(missing_ok=True)
        env = {**self._environ, HEARTBEAT_DIR_ENV: str(folder), ATTEMPT_ENV: str(self.attempt)}
        log.info("torchvitals supervise: attempt %d: %s", self.attempt, " ".join(self.command))
        started = time.time()
        # The launcher dies with this supervisor: a SIGKILLed supervisor leaves no job running
        # unsupervised (the other nodes then see this node lost).
        self._proc = proc = subprocess.Popen(
            self.command, env=env, start_new_session=True, preexec_fn=die_with_parent()
        )
        self.peers.started(self.attempt)
        hang = HangClock(self.config, self.intervals, self._clock())
        while True:
            status = proc.poll()
            if status is not None:
                self.history.append(Attempt(self.attempt, started, time.time(), "exit", status))
                # Ranks the launcher left behind would hold ports and files of the next attempt.
                stop_group(proc, self.config.grace_s, _pids(folder))
                return "exit", status, None
            now = self._clock()
            beat = read_heartbeats(folder)
            hang.observe(beat, now)
            hang.between_workers = bool(beat and beat.pids) and not any(map(running, beat.pids))
            self.metrics.heartbeat_age.set(hang.age(now))
            order = self.peers.watch(self.attempt, 0 if hang.beat is None else hang.beat.step)
            if order is not None:
                ended = time.time()
                if order.final is not None:
                    log.error(
                        "torchvitals supervise: the job ends on another node's word (%s); "
                        "stopping this node's launcher",
                        order.reason,
                    )
                elif order.lost:
                    log.error(
                        "torchvitals supervise: %s; stopping this node's launcher and "
                        "waiting up to %g s for a node to take its place",
                        order.reason,
                        self.config.peer_timeout_s,
                    )
                else:
                    log.warning(
                        "torchvitals supervise: the job restarts into attempt %d (%s); "
                        "stopping this node's launcher",
                        order.attempt,
                        order.reason,
                    )
                status = stop_group(proc, self.config.grace_s, _pids(folder))
                self.history.append(Attempt(self.attempt, started, ended, "peer", status))
                return "peer", status, order
            if hang.hung(now):
                log.warning(
                    "torchvitals supervise: no heartbeat advance for %.1f s (timeout "
                    "%.1f s, last %s); stopping the job",
                    hang.age(now),
                    hang.timeout(),
                    hang.beat,
                )
                ended = time.time()
                status = stop_group(proc, self.config.grace_s, _pids(folder))
                self.history.append(Attempt(self.attempt, started, ended, "hang", status))
                return "hang", status, None
            self._sleep(self.config.poll_s)

    def _progress(self, folder: Path) -> int | None:
        """The last healthy step (the ledger's), or the attempt's highest heartbeat step."""
        if self.config.checkpoint_dir is None:
            beat = read_heartbeats(folder)
            return None if beat is None else beat.step
        try:
            entry = (
                Ledger(Path(self.config.checkpoint_dir) / LEDGER_FILE, writer=False)
                .load()
                .last_checkpoint
            )
        except LedgerError as exc:
            log.error("torchvitals supervise: %s", exc)
            return None
        return None if entry is None else int(entry["step"])


def _job_id(config: SupervisorConfig, environ: dict[str, str], command: list[str]) -> str:
    """The job's identity: the scheduler's or ours from the environment, else torchrun's
    ``--rdzv-id`` on the command line; one node without either makes one (every attempt of
    this supervisor is then one job, and a later ``supervise`` a new job).

    Raises:
        ValueError: several nodes and no id: each node would make its own.
    """
    found = job_identity(environ) or launcher_job_id(command)
    if found is not None:
        return found
    if config.nnodes > 1:
        raise ValueError(
            f"a job of {config.nnodes} nodes needs one job id on every node: set "
            f"{JOB_ID_ENV}, run under Slurm (SLURM_JOB_ID), or pass torchrun "
            "--rdzv-id"
        )
    return uuid.uuid4().hex


def store_of(config: SupervisorConfig) -> EtcdStore:
    """The job's store as ``config`` describes it: its URL, TLS files, user and password.

    Raises:
        ValueError: a TLS file or the password file cannot be read (the message names the
            field): a setting to fix before the start, like every other refused setting.
    """
    try:
        return EtcdStore(
            config.store_url or "",
            tls=StoreTLS(
                cafile=config.store_cafile,
                certfile=config.store_certfile,
                keyfile=config.store_keyfile,
            ),
            user=config.store_user,
            password=config.password(),
        )
    except StoreError as exc:
        raise ValueError(str(exc)) from None


def _pids(folder: Path) -> tuple[int, ...]:
    """The pids the ranks wrote into their heartbeat files (torchrun's workers live outside the
    launcher's process group)."""
    beat = read_heartbeats(folder)
    return () if beat is None else beat.pids


def supervise(config: SupervisorConfig, command: Sequence[str]) -> int:
    """Run ``command`` under ``config``, with /metrics when configured and SIGTERM/SIGINT
    passed on to the job's process group.

    Returns:
        The exit status (0, ``abort_exit_code``, ``no_progress_exit_code``,
        ``budget_exit_code``, ``refused_exit_code``, ``node_lost_exit_code``, 1 when the job's
        store stopped answering or refused us, 2 for a job of several nodes without a job id or
        an unreadable store TLS or password file, or 128 + the signal that stopped the
        supervisor).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        supervisor = Supervisor(config, command)
    except ValueError as exc:
        log.error("torchvitals supervise: %s", exc)
        return 2
    if config.metrics_port:
        from prometheus_client import start_http_server

        try:
            start_http_server(
                config.metrics_port,
                addr=config.metrics_host,
                registry=supervisor.metrics.registry,
                certfile=config.metrics_certfile,
                keyfile=config.metrics_keyfile,
                client_cafile=config.metrics_client_cafile,
                client_auth_required=bool(config.metrics_client_cafile),
            )
        except OSError as exc:  # a taken port or a bad certificate: watch the job anyway
            log.error(
                "torchvitals supervise: no /metrics on %s:%d (%s); supervising without",
                config.metrics_host,
                config.metrics_port,
                exc,
            )

    class _Stopped(Exception):
        pass

    def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        raise _Stopped(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return supervisor.run()
    except StoreError as exc:
        log.error(
            "torchvitals supervise: the job's store does not answer (%s); stopping this node's job",
            exc,
        )
        supervisor.stop()
        return 1
    except _Stopped as stopped:
        log.warning("torchvitals supervise: signal %d; stopping the job", stopped.args[0])
        supervisor.stop()
        return 128 + stopped.args[0]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
