"""One attempt of the supervised job: start the launcher, watch it, stop its processes.

    runner = AttemptRunner(config, command, environ, metrics, peers)
    outcome = runner.run(number=2, folder=root / "attempt-0002")   # Exited, Hung or Ordered

The launcher runs in its own process group with ``TORCHVITALS_HEARTBEAT_DIR`` set to the
attempt's fresh folder, where every rank's agent keeps ``heartbeat-rank<r>.json`` (the format:
``torchvitals.protocol``). Only those files are read, so a hang is seen even when a rank is
SIGSTOPped or holds its GIL (``hang_clock``). The attempt ends when the launcher exits, when the
heartbeat stops advancing, or when the job's other nodes order it stopped; the whole group is
then stopped (SIGTERM, SIGKILL after ``grace_s``) before the outcome is returned.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from ...protocol import ATTEMPT_ENV, HEARTBEAT_DIR_ENV, HEARTBEAT_GLOB, read_heartbeats
from .hang_clock import HangClock
from .options import SupervisorConfig
from .outcomes import Exited, Hung, Ordered, Outcome
from .peers import JobEnded, JobRestarted, NodesLost, Peers
from .process import die_with_parent, running, stop_group
from .telemetry import SupervisorMetrics

log = logging.getLogger("torchvitals.supervisor")


class AttemptRunner:
    """Runs the command once per call, watched by its heartbeats and the job's other nodes.

    Args:
        config: ``grace_s``, ``poll_s``, ``peer_timeout_s`` and the hang timeouts.
        command: the launcher and its arguments.
        environ: the job's environment (the attempt's folder and number are added).
        metrics: where the heartbeat age is shown.
        peers: the other nodes' supervisors (told of the start, asked at every poll).
        clock, sleep: monotonic seconds and the wait between polls.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        command: Sequence[str],
        environ: dict[str, str],
        metrics: SupervisorMetrics,
        peers: Peers,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config, self.command, self.environ = config, list(command), environ
        self.metrics, self.peers = metrics, peers
        self._clock, self._sleep = clock, sleep
        self.intervals: deque[float] = deque(maxlen=1000)
        """Seconds between heartbeat advances, kept across attempts (the learned timeout)."""
        self._proc: subprocess.Popen | None = None
        self._folder: Path | None = None

    def run(self, number: int, folder: Path) -> Outcome:
        """Attempt ``number``, with its heartbeats in ``folder``, until it exits, hangs or the
        job orders it stopped; its processes are stopped before this returns."""
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(HEARTBEAT_GLOB):  # a requeued job may reuse the number
            stale.unlink(missing_ok=True)
        env = {**self.environ, HEARTBEAT_DIR_ENV: str(folder), ATTEMPT_ENV: str(number)}
        log.info("torchvitals supervise: attempt %d: %s", number, " ".join(self.command))
        started = time.time()
        self._folder = folder
        # The launcher dies with this supervisor: a SIGKILLed supervisor leaves no job running
        # unsupervised (the other nodes then see this node lost). The preexec_fn makes
        # system calls only (prctl resolved before the fork), taking no lock that another
        # thread (the lease keeper) could hold at the fork.
        self._proc = proc = subprocess.Popen(
            self.command,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        self.peers.started(number)
        hang = HangClock(self.config, self.intervals, self._clock())

        def ended(kind: type[Outcome], end: float, status: int, **details) -> Outcome:
            return kind(
                number=number,
                started=started,
                ended=end,
                status=status,
                beat=read_heartbeats(folder),  # after the stop: the ranks' last word
                **details,
            )

        while True:
            status = proc.poll()
            if status is not None:
                end = time.time()
                # Ranks the launcher left behind would hold ports and files of the next attempt.
                stop_group(proc, self.config.grace_s, _pids(folder))
                return ended(Exited, end, status)
            now = self._clock()
            beat = read_heartbeats(folder)
            hang.observe(beat, now)
            hang.between_workers = bool(beat and beat.pids and not any(map(running, beat.pids)))
            self.metrics.heartbeat_age.set(hang.age(now))
            order = self.peers.watch(number, 0 if hang.beat is None else hang.beat.step)
            if order is not None:
                end = time.time()
                self._log_order(order)
                status = stop_group(proc, self.config.grace_s, _pids(folder))
                return ended(Ordered, end, status, order=order)
            if hang.hung(now):
                age, timeout = hang.age(now), hang.timeout()
                log.warning(
                    "torchvitals supervise: no heartbeat advance for %.1f s (timeout "
                    "%.1f s, last %s); stopping the job",
                    age,
                    timeout,
                    hang.beat,
                )
                end = time.time()
                status = stop_group(proc, self.config.grace_s, _pids(folder))
                return ended(Hung, end, status, age_s=age, timeout_s=timeout)
            self._sleep(self.config.poll_s)

    def stop(self) -> None:
        """Stop the running attempt's processes (a signal to the supervisor itself)."""
        if self._proc is not None and self._folder is not None and self._proc.poll() is None:
            stop_group(self._proc, self.config.grace_s, _pids(self._folder))

    def _log_order(self, order: JobRestarted | NodesLost | JobEnded) -> None:
        if isinstance(order, JobEnded):
            log.error(
                "torchvitals supervise: the job ends on another node's word (%s); "
                "stopping this node's launcher",
                order.reason,
            )
        elif isinstance(order, NodesLost):
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


def _pids(folder: Path) -> tuple[int, ...]:
    """The pids the ranks wrote into their heartbeat files (torchrun's workers live outside the
    launcher's process group)."""
    beat = read_heartbeats(folder)
    return () if beat is None else beat.pids
