"""The start barrier of an attempt: every node of the job at it before any launcher starts.

    barrier = StartBarrier(keys, membership, config, metrics, announce=..., finish=..., ...)
    go = barrier.wait(attempt)     # StartAttempt(n), or JobEnded(code, reason)

Each node at the barrier marks it (``ready/a<attempt>/<node>``) and looks, every
``store_poll_s``, at how many marks there are: one small answer from the store however many
nodes the job has. Only when the count says every node came (and every ``FULL_LOOK_EVERY``
looks while it does not, to name a node that is gone) does it read every node's record.

A phase of its own: no launcher runs, so nothing can hang. A node that does not come within
``peer_timeout_s`` is lost: the job then goes on with the nodes there are when ``min_nodes``
allows (torchrun ``--nnodes MIN:MAX``), else ends with ``node_lost_exit_code`` on every node.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .etcd import StoreError
from .job_store import JobStore, StoreOutage
from .membership import Membership
from .options import SupervisorConfig
from .orders import JobEnded, StartAttempt
from .telemetry import SupervisorMetrics

log = logging.getLogger("torchvitals.supervisor")

FULL_LOOK_EVERY = 10
"""While the count of nodes at the barrier falls short, every node's record is read at every
this many looks (a node gone is named in the log, the metrics show who is present)."""


class StartBarrier:
    """Waits for the job's nodes at the start of an attempt.

    Args:
        keys: the job's keys.
        membership: the job's nodes.
        config: ``nnodes``, ``min_nodes``, ``peer_timeout_s``, ``store_poll_s``,
            ``node_lost_exit_code``.
        metrics: where the wait for peers is shown.
        announce: publishes that this node waits for an attempt (once per change).
        finish: ends the job for good on every node; returns the code they all end with.
        outage: logs a blink of the store once.
        clock, sleep: monotonic seconds and the wait between polls.
    """

    def __init__(
        self,
        keys: JobStore,
        membership: Membership,
        config: SupervisorConfig,
        metrics: SupervisorMetrics,
        *,
        announce: Callable[[int], None],
        finish: Callable[[int, str], int],
        outage: StoreOutage,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.keys, self.membership, self.config, self.metrics = keys, membership, config, metrics
        self._announce, self._finish, self._outage = announce, finish, outage
        self._clock, self._sleep = clock, sleep
        self._looks = 0

    def wait(self, attempt: int) -> StartAttempt | JobEnded:
        """Publish "waiting" for ``attempt`` and wait until every node is at it (or running it).

        Returns:
            ``StartAttempt(n)`` to start attempt n (a later one when the job moved on while
            waiting), or ``JobEnded`` when the job ended, or no node came in time.
        """
        self.metrics.waiting_for_peers.set(1)
        try:
            deadline = self._clock() + self.config.peer_timeout_s
            reported: set[int] = set()
            while True:
                try:
                    order = self._poll(attempt, deadline, reported)
                except StoreError as exc:  # a blink of the store; the deadline still holds
                    self._outage.failed(exc)
                    order = None
                if isinstance(order, StartAttempt) and order.attempt != attempt:
                    attempt = order.attempt  # the job moved on while this node waited
                    deadline = self._clock() + self.config.peer_timeout_s
                    continue
                if order is not None:
                    return order
                if self._clock() > deadline:
                    return self._timed_out(attempt)
                self._sleep(self.config.store_poll_s)
        finally:
            self.metrics.waiting_for_peers.set(0)

    def _poll(
        self, attempt: int, deadline: float, reported: set[int]
    ) -> StartAttempt | JobEnded | None:
        """One look at the barrier: an order to start (maybe a later attempt), the end, or None
        (keep waiting)."""
        self._announce(attempt)
        live = self.keys.live
        final = self.keys.final(cached=live)
        if final is not None and final.attempt >= attempt:
            return JobEnded(final.code, final.reason)
        record = self.keys.attempt(cached=live)
        if record.number > attempt:
            return StartAttempt(record.number)
        self._looks += 1
        came = self.keys.ready_count(attempt)
        if came < len(self.membership.members) and self._looks % FULL_LOOK_EVERY != 1:
            return None  # not every node yet: their records would say no more
        ready = self.membership.ready(attempt)
        if ready >= self.membership.members:
            self.membership.members |= ready  # a replacement rejoins a job that went on without it
            return StartAttempt(attempt)
        for n in self.membership.gone(ready):
            if n in reported:
                continue
            reported.add(n)
            log.error(
                "torchvitals supervise: %s; waiting up to %.0f s more for a node to take its place",
                self.membership.describe(n),
                max(0.0, deadline - self._clock()),
            )
        return None

    def _timed_out(self, attempt: int) -> StartAttempt | JobEnded:
        """No full house within ``peer_timeout_s``: go on with fewer nodes, or end the job."""
        ready = self.membership.ready(attempt)
        missing = sorted(self.membership.members - ready)
        why = "; ".join(self.membership.describe(n) for n in missing)
        fewest = self.config.min_nodes or self.config.nnodes
        if len(ready) >= fewest and self.membership.node in ready:
            # torchrun --nnodes MIN:MAX: go on with the nodes there are; the job resumes its
            # last healthy checkpoint at the new world size.
            self.membership.members = ready
            log.error(
                "torchvitals supervise: %s: no node took its place within %g s; the job goes "
                "on with %d of %d nodes (%s): the world size changes",
                why,
                self.config.peer_timeout_s,
                len(ready),
                self.config.nnodes,
                ", ".join(map(str, sorted(ready))),
            )
            return StartAttempt(attempt)
        reason = (
            f"{why}: no node took its place within "
            f"{self.config.peer_timeout_s:g} s (peer_timeout_s)"
        )
        log.error("torchvitals supervise: %s; stopping the job", reason)
        return JobEnded(self._finish(self.config.node_lost_exit_code, reason), reason)
