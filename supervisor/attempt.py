"""One attempt of the supervised job: start the launcher, watch it, stop its processes.

    runner = AttemptRunner(config, command, environ, metrics, peers, localizer)
    outcome = runner.run(number=2, folder=root / "attempt-0002")   # Exited, Hung or Ordered

The launcher runs in its own process group with ``TORCHVITALS_HEARTBEAT_DIR`` set to the
attempt's fresh folder, where every rank's agent keeps ``heartbeat-rank<r>.json`` (the format:
``torchvitals.protocol``). Only those files are read, so a hang is seen even when a rank is
SIGSTOPped or holds its GIL (``hang_clock``). The attempt ends when the launcher exits, when the
heartbeat stops advancing, or when the job's other nodes order it stopped; the whole group is
then stopped (SIGTERM, SIGKILL after ``grace_s``) before the outcome is returned.

Every disruption is localized before anything is stopped (``localizer``): a hang's ranks are
looked at where they hang, a crash's first death is named with its exit status, a lost node
with the step the job reached. torchrun restarting its own workers within the attempt
(``--max-restarts``) is seen as the ranks' pids vanishing while the launcher runs: one crash
incident per worker group, and the new group's start is bounded like any re-start.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from ..protocol import (
    ATTEMPT_ENV,
    HEARTBEAT_DIR_ENV,
    HEARTBEAT_GLOB,
    RankBeat,
    combine_beats,
    read_heartbeats,
    read_rank_beats,
)
from ..records.vocabulary import CRASH, HANG
from .disruptions import Disruptions
from .hang_clock import HangClock
from .localizer import Localizer, generation_of, incident_key
from .options import SupervisorConfig
from .orders import JobEnded, JobRestarted, NodesLost
from .outcomes import Exited, Hung, Ordered, Outcome
from .peers import Peers
from .process import die_with_parent, stop_group
from .telemetry import SupervisorMetrics
from .witness import Witness
from .worker_groups import WorkerGroups, failed

log = logging.getLogger("torchvitals.supervisor")


class AttemptRunner:
    """Runs the command once per call, watched by its heartbeats and the job's other nodes.

    Args:
        config: ``grace_s``, ``poll_s``, ``peer_timeout_s``, the hang timeouts and bounds.
        command: the launcher and its arguments.
        environ: the job's environment (the attempt's folder and number are added).
        metrics: where the heartbeat age is shown.
        peers: the other nodes' supervisors (told of the start, asked at every poll).
        book: where incidents are written (default: into the heartbeat folder's parent).
        clock, sleep: monotonic seconds and the wait between polls.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        command: Sequence[str],
        environ: dict[str, str],
        metrics: SupervisorMetrics,
        peers: Peers,
        book: Disruptions,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config, self.command, self.environ = config, list(command), environ
        self.metrics, self.peers, self.book = metrics, peers, book
        self.node, self.host = config.node_rank or 0, socket.gethostname()
        self.localizer = Localizer(config, peers, book, node=self.node, host=self.host, clock=clock)
        self._clock, self._sleep = clock, sleep
        self.intervals: deque[float] = deque(maxlen=1000)
        """Seconds between heartbeat advances, kept across attempts (the learned timeout)."""
        self.first_start_s: float | None = None
        """The job's first start (attempt start to first heartbeat), learned once: a re-start's
        bound is a multiple of it."""
        self._proc: subprocess.Popen | None = None
        self._folder: Path | None = None
        self.running_since: float | None = None
        """Unix seconds the running attempt started (None: none runs)."""

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
            stderr=subprocess.PIPE if self.config.tee_stderr else None,
        )
        witness = Witness(
            folder,
            node=self.node,
            host=self.host,
            stderr=proc.stderr,
            probe_wait_s=self.config.probe_wait_s,
            mark=partial(self.peers.mark_death, number),
            clock=self._clock,
        )
        self.running_since = started
        try:
            self.peers.started(number)
            outcome = self._watch(number, folder, proc, witness, started)
        except BaseException:
            # A signal to the supervisor (its stop follows) or a store gone: the copy of the
            # launcher's stderr goes on in the background, for its last words.
            witness.close(0)
            raise
        witness.close(self.config.probe_wait_s)  # every process is stopped: the pipe ends
        self.running_since = None
        return outcome

    def _watch(
        self,
        number: int,
        folder: Path,
        proc: subprocess.Popen,
        witness: Witness,
        started: float,
    ) -> Outcome:
        hang = HangClock(
            self.config, self.intervals, self._clock(), first_start_s=self.first_start_s
        )
        workers = WorkerGroups()

        def ended(kind: type[Outcome], end: float, status: int, **details) -> Outcome:
            return kind(
                number=number,
                started=started,
                ended=end,
                stopped=time.time(),
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
                witness.close(self.config.probe_wait_s)  # the launcher's last words
                key = None
                if status != 0 and workers.generation not in workers.crashed:
                    key = self._crash(number, witness, workers, hang, end, status)
                return ended(Exited, end, status, incident=key)
            now = self._clock()
            beats = read_rank_beats(folder)
            beat = combine_beats(beats)
            witness.poll(beats)
            self._follow(workers, beats, hang, now)
            if self.first_start_s is None:
                self.first_start_s = hang.first_start_s
            self.metrics.heartbeat_age.set(hang.age(now))
            if workers.dead_at is not None and workers.generation not in workers.judged:
                self._wait_for_report(proc, witness, beats)
                if proc.poll() is None:  # torchrun goes on: it restarts its workers
                    workers.judged.add(workers.generation)
                    if failed(witness, beats):
                        self._crash(number, witness, workers, hang, workers.dead_at, None)
                    continue
            self.localizer.answer(number, witness)
            order = self.peers.watch(number, 0 if beat is None else beat.step)
            if order is not None:
                end = time.time()
                # A hang or a crash elsewhere: this node's findings before its ranks are stopped.
                self.localizer.answer(number, witness, now=True)
                if isinstance(order, NodesLost):
                    self.localizer.lost(
                        number, order, detected_at=end, last_advance=_last_advance(hang, started)
                    )
                self._log_order(order)
                status = stop_group(proc, self.config.grace_s, _pids(folder))
                return ended(Ordered, end, status, order=order)
            if hang.hung(now):
                end = time.time()
                age, timeout = hang.age(now), hang.timeout()
                key = incident_key(HANG, number, workers.current)
                incident = self.localizer.hang(number, key, witness, clock=hang, detected_at=end)
                log.warning(
                    "torchvitals supervise: no heartbeat advance for %.1f s (timeout "
                    "%.1f s, %s, last %s): %s; stopping the job",
                    age,
                    timeout,
                    hang.phase(),
                    hang.beat,
                    incident.cause,
                )
                status = stop_group(proc, self.config.grace_s, _pids(folder))
                return ended(
                    Hung,
                    end,
                    status,
                    age_s=age,
                    timeout_s=timeout,
                    phase=hang.phase(),
                    incident=key,
                )
            self._sleep(self.config.poll_s)

    def _follow(
        self, workers: WorkerGroups, beats: dict[int, RankBeat], hang: HangClock, now: float
    ) -> None:
        """Follow torchrun's worker groups: the first heartbeat of new workers is the job
        training again (the pending incidents recovered); every rank gone while the launcher
        runs is a re-start for the hang clock."""
        started_at, dead = workers.follow(beats)
        if started_at is not None:
            self.book.recovered(started_at)
        hang.observe(combine_beats(beats), now)
        hang.between_workers(dead, now)

    def _wait_for_report(
        self, proc: subprocess.Popen, witness: Witness, beats: dict[int, RankBeat]
    ) -> None:
        """Wait up to ``probe_wait_s`` for the launcher's report of the dead group (torchrun
        logs it once it has stopped the rest), or for the launcher to exit."""
        pids = {b.pid for b in beats.values()}
        deadline = self._clock() + self.config.probe_wait_s
        while self._clock() < deadline and proc.poll() is None:
            if pids & set(witness.failures()):
                return
            self._sleep(min(0.05, self.config.poll_s))

    def _crash(
        self,
        number: int,
        witness: Witness,
        workers: WorkerGroups,
        hang: HangClock,
        seen: float,
        launcher_status: int | None,
    ) -> str | None:
        """Localize the crash of the current worker group (unless the ranks ended on purpose:
        an abort, a refused folder); returns the incident's key."""
        workers.crashed.add(workers.generation)
        beat = read_heartbeats(witness.folder)
        if beat is not None and (beat.aborted or beat.refused):
            return None
        key = incident_key(CRASH, number, workers.generation)
        elsewhere = sorted(
            k
            for k in self.peers.asked(number)
            if k != key and generation_of(k) == workers.generation
        )
        if elsewhere:
            # Another node is naming a hang or a crash of these workers and stops its ranks:
            # this node's died of it (their collectives failed), a consequence, not an incident.
            log.warning(
                "torchvitals supervise: this node's ranks died while %s was being named "
                "elsewhere: not a crash of their own",
                ", ".join(elsewhere),
            )
            return None
        first = min((d.at for d in witness.deaths() if d.at <= seen), default=seen)
        incident = self.localizer.crash(
            number,
            key,
            witness,
            step=None if hang.beat is None else hang.beat.step,
            detected_at=first,
            last_advance=_last_advance(hang, None),
            launcher_status=launcher_status,
        )
        log.warning(
            "torchvitals supervise: %s of attempt %d: %s", incident.key, number, incident.cause
        )
        return incident.key

    def stop(self) -> int | None:
        """Stop the running attempt's processes (a signal to the supervisor itself); returns
        the launcher's exit status (None: none ran)."""
        if self._proc is None or self._folder is None:
            return None
        if self._proc.poll() is None:
            return stop_group(self._proc, self.config.grace_s, _pids(self._folder))
        return self._proc.returncode

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


def _last_advance(hang: HangClock, started: float | None) -> float | None:
    """Unix seconds of the job's last heartbeat (its ranks' own clock), else ``started``."""
    return hang.beat.time if hang.beat is not None else started


def _pids(folder: Path) -> tuple[int, ...]:
    """The pids the ranks wrote into their heartbeat files (torchrun's workers live outside the
    launcher's process group)."""
    beat = read_heartbeats(folder)
    return () if beat is None else beat.pids
