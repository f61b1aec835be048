"""The supervisor: run a training launcher, restart it when it crashes or hangs.

    torchvitals supervise --checkpoint-dir ckpt --hang-timeout-s 120 -- torchrun ... train.py

Each attempt runs the same command with a fresh heartbeat folder (``attempt``), watched for a
hang from the ranks' heartbeats (``hang_clock``); how it ended (``outcomes``) goes to the
restart policy (``restart_policy``), whose decision the loop carries out: the job is restarted
after a back-off, or the supervisor exits. The job resumes itself through the watchdog's
ledger, as the one job ``TORCHVITALS_JOB_ID`` names (set for every attempt). The launcher dies
with the supervisor (a parent-death signal). Exit status: 0 when the job exits 0,
``abort_exit_code`` (75) when the job aborted on purpose (the agent's loop guard or a
collector's abort order, told by the heartbeat's "aborted" phase: never restarted),
``no_progress_exit_code`` (76) when ``no_progress_restarts`` restarts in a row failed without
advancing the last healthy step, ``budget_exit_code`` (77) when ``max_restarts`` restarts are
spent, ``refused_exit_code`` (78) when the job refused its checkpoint folder or found its
ledger corrupt (the "refused" phase: never retried), ``node_lost_exit_code`` (79) when a node
was lost and not replaced.

With ``store_url``, the supervisors of the job's ``nnodes`` nodes agree through it
(``store_peers``): the attempt and the restart policy's state are the job's, not the node's, so
a restart anywhere stops and restarts every node's launcher together, and the end of the job is
every node's.

Each disruption (a hang, a crash, a lost node) becomes an incident in the job's folder
(``job_dir``, else ``checkpoint_dir``, else the heartbeat root) naming its culprit
(``localizer``), and each node writes its goodput timeline there: the wait for the other nodes,
every attempt's start, detection and end, and the end of its supervision (``disruptions``);
node 0's /metrics serves the job's goodput computed from them (``goodput_export``).
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from ..protocol import JOB_ID_ENV, LEDGER_FILE, NODE_ENV, read_heartbeats
from ..records.jobid import job_identity, launcher_job_id
from ..records.ledger import Ledger, LedgerError
from .attempt import AttemptRunner
from .disruptions import Disruptions
from .goodput_export import GoodputCollector
from .options import SupervisorConfig, node_rank
from .orders import JobEnded, StartAttempt
from .outcomes import Outcome
from .peers import Peers, SoloPeers
from .restart_policy import (
    Decision,
    Follow,
    GiveUp,
    NoRestart,
    Obey,
    Restart,
    RestartPolicy,
    Succeed,
    failure,
)
from .store_peers import StorePeers, store_of
from .store_schema import JobAttempt
from .telemetry import SupervisorMetrics

log = logging.getLogger("torchvitals.supervisor")


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
        policy: when to restart (default: the one ``config`` sets out).
    """

    config: SupervisorConfig
    command: list[str]
    metrics: SupervisorMetrics
    job_id: str
    peers: Peers
    policy: RestartPolicy
    runner: AttemptRunner
    root: Path
    """Holds one heartbeat folder per attempt (``attempt-0001`` ...)."""
    book: Disruptions
    """This node's incidents and goodput timeline, in the job's folder."""
    attempt: int
    """The attempt running or last run (0 before the first)."""
    restarts: int
    """Restarts of the job so far (any node's)."""
    history: list[Outcome]
    """How every attempt so far ended, oldest first."""

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
        policy: RestartPolicy | None = None,
    ) -> None:
        if not command:
            raise ValueError("no command to supervise (put it after --)")
        self.command = list(command)
        self.metrics = SupervisorMetrics() if metrics is None else metrics
        self._sleep = sleep
        environ = dict(os.environ if environ is None else environ)
        self.job_id = _job_id(config, environ, self.command)
        config = self.config = replace(config, node_rank=node_rank(config, environ))
        # Every attempt, on every node, is the same job: the ledger continues it after any
        # restart and refuses it to another job (torchvitals.records.jobid).
        environ[JOB_ID_ENV] = self.job_id
        # The ranks name their node as the supervisors do (torchrun's GROUP_RANK follows the
        # c10d rendezvous' arrival order, which may differ): an agent's incident and a
        # supervisor's then agree on the culprit's node.
        environ[NODE_ENV] = str(config.node_rank)
        if peers is None:
            peers = (
                StorePeers(
                    store_of(config), self.job_id, config, self.metrics, clock=clock, sleep=sleep
                )
                if config.store_url
                else SoloPeers()
            )
        self.peers = peers
        self.policy = RestartPolicy.from_config(config) if policy is None else policy
        self.root = Path(config.heartbeat_root or tempfile.mkdtemp(prefix="torchvitals-supervise-"))
        folder = Path(config.job_dir or config.checkpoint_dir or self.root)
        self.book = Disruptions(
            folder, node=config.node_rank or 0, host=socket.gethostname(), metrics=self.metrics
        )
        if not config.node_rank:
            # Node 0 serves the job's goodput, computed from the folder at scrape time.
            self.metrics.registry.register(GoodputCollector(folder))
        self.runner = AttemptRunner(
            config, self.command, environ, self.metrics, peers, self.book, clock=clock, sleep=sleep
        )
        self.attempt = self.restarts = 0
        self.history = []

    def run(self) -> int:
        """Supervise until the job succeeds or the policy gives up; returns the exit status."""
        try:
            code = self._run()
        finally:
            self.peers.close()
        self.ended(code)
        return code

    def ended(self, code: int) -> None:
        """Supervision ends with ``code`` (also when a signal stopped it): the timeline's last
        line."""
        self.book.timeline.ended(at=time.time(), code=code)
        self.book.close()

    def _run(self) -> int:
        job = self.peers.join()
        while True:
            waited = time.time()
            go = self.peers.wait_for_peers(job.number)
            self.book.timeline.waited(
                go.attempt if isinstance(go, StartAttempt) else job.number,
                start=waited,
                end=time.time(),
            )
            if isinstance(go, JobEnded):
                return go.code
            job = self._enter(go.attempt, job)
            outcome = self.runner.run(self.attempt, self._folder())
            self.history.append(outcome)
            self.book.timeline.attempt(
                outcome.number,
                start=outcome.started,
                end=outcome.stopped if outcome.stopped is not None else time.time(),
                reason=outcome.reason,
                status=outcome.status,
                detected=outcome.ended,
            )
            decision = self.policy.settle(outcome, job)
            if decision is None:  # a crash or a hang: the limits decide
                decision = self._after_failure(outcome)
            if isinstance(decision, (Restart, Follow)):
                job = self._go_on(decision)
            else:
                return self._end(decision)

    def stop(self, code: int | None = None) -> None:
        """Stop the running attempt's processes (a signal to the supervisor itself); with
        ``code``, supervision ends with it (the timeline's last lines)."""
        started, seen = self.runner.running_since, time.time()
        status = self.runner.stop()
        if code is not None:
            if started is not None:  # the attempt it interrupted ends with the launcher's exit
                self.book.timeline.attempt(
                    self.attempt,
                    start=started,
                    end=time.time(),
                    reason="exit",
                    status=code if status is None else status,
                    detected=seen,
                )
            self.ended(code)

    def _enter(self, attempt: int, job: JobAttempt) -> JobAttempt:
        """Make ``attempt`` this node's; returns the job's record for it."""
        if attempt != job.number:
            job = self.peers.current()
        self.attempt, self.restarts = attempt, job.restarts
        self.metrics.attempt.set(attempt)
        return job

    def _after_failure(self, outcome: Outcome) -> Decision:
        """Ask the policy about a crash or a hang, with the job's record and progress now."""
        job = self.peers.current()
        if job.number != self.attempt:
            return Follow()  # another node restarted the job meanwhile: follow it
        progress = self._progress(self._folder())
        log.warning(
            "torchvitals supervise: attempt %d ended by %s (status %s); last healthy step %s",
            self.attempt,
            failure(outcome),
            outcome.status,
            progress,
        )
        return self.policy.after_failure(outcome, job, progress)

    def _go_on(self, decision: Restart | Follow) -> JobAttempt:
        """Restart the job (every node's supervisor follows at once), or follow another node's
        restart; returns the job's record for the next attempt."""
        if decision.label is not None:
            self.metrics.restarts.labels(decision.label).inc()
        if isinstance(decision, Follow):
            return self.peers.current()
        job = self.peers.restart(decision.record)
        self.restarts = job.restarts
        if decision.backoff_s is not None:
            self._sleep(decision.backoff_s)
        return job

    def _end(self, decision: Succeed | Obey | NoRestart | GiveUp) -> int:
        """End this node's supervision as decided; returns the exit status."""
        if isinstance(decision, Succeed):
            log.info("torchvitals supervise: the job finished (attempt %d)", self.attempt)
            self.peers.done()
            return 0
        if isinstance(decision, Obey):
            return decision.code
        if isinstance(decision, NoRestart):
            log.error("torchvitals supervise: %s: not restarting", decision.why)
        else:
            log.error("torchvitals supervise: %s; giving up", decision.why)
        return self.peers.finish(decision.code, decision.why)

    def _folder(self) -> Path:
        """The current attempt's heartbeat folder."""
        return self.root / f"attempt-{self.attempt:04d}"

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
