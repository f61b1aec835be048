"""What one node's supervisor writes into the job's folder: its incidents (hang, crash, lost
node), what each cost once the job trained again, and its goodput timeline.

    book = Disruptions(job_folder, node=0, host="h", metrics=metrics)
    book.record(incident, last_advance=beat.time)   # once per key, whichever node is first
    book.recovered(at=first_new_heartbeat)           # fills in recovered_at and lost_seconds
    book.timeline.attempt(2, start=..., end=..., reason="hang", status=-15, detected=...)

An incident this node wrote (``IncidentLog.record``: the first writer of a key wins) stays
pending until the job trains again: the first heartbeat of the restarted workers, or of the next
attempt. Then its ``recovered_at`` is that heartbeat's time and its ``lost_seconds`` the wall time
the disruption held the job still: from the last heartbeat advance before the fault to that first
new heartbeat (detection, the localization, the stop, the back-off, the start barrier, the
restart and the resume). Where a second disruption came before the job trained again (a crash,
then its restart stuck at startup), the first one's cost ends at the second's detection. Steps
done again after the resume are not in it: the goodput accounting counts them as lost progress,
from the steps' own records.

The counter ``torchvitals_supervisor_incidents_total`` counts the incidents this node wrote, so
the sum over the nodes counts each incident once. A folder that cannot be written is logged and
supervision goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..records.incidents import Incident, IncidentLog
from ..records.timeline import SupervisorTimeline
from .telemetry import SupervisorMetrics

log = logging.getLogger("torchvitals.supervisor")


@dataclass(frozen=True)
class _Pending:
    key: str
    last_advance: float
    """Unix seconds of the job's last heartbeat advance before the fault."""
    detected_at: float
    """When the fault was seen: where an earlier pending incident's cost ends."""


class Disruptions:
    """This node's incidents and goodput timeline in the job's folder.

    Args:
        folder: the job's folder (the checkpoint folder every node shares).
        node: this node's rank.
        host: this node's host name.
        metrics: where the incidents are counted.
        wall: unix seconds.
    """

    def __init__(
        self,
        folder: Path,
        *,
        node: int,
        host: str,
        metrics: SupervisorMetrics,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.folder, self.node, self.host, self.metrics = folder, node, host, metrics
        self.incidents = IncidentLog(folder)
        self.timeline = SupervisorTimeline(folder, node=node)
        self.writer = f"supervisor node {node}"
        self._wall = wall
        self._pending: list[_Pending] = []
        self._failed = False

    def record(self, incident: Incident, *, last_advance: float | None) -> bool:
        """Write ``incident`` unless another node or rank wrote its key first.

        Args:
            incident: the record.
            last_advance: unix seconds of the job's last heartbeat advance before the fault
                (the start of its ``lost_seconds``; None: not counted).

        Returns:
            Whether this node wrote it.
        """
        try:
            wrote = self.incidents.record(incident)
        except OSError as exc:
            if not self._failed:
                log.error(
                    "torchvitals supervise: cannot write incidents into %s (%s); supervising "
                    "without",
                    self.incidents.path,
                    exc,
                )
            self._failed = True
            return False
        if not wrote:
            return False
        c = incident.culprit
        self.metrics.incidents.labels(
            incident.kind,
            "" if c.rank is None else str(c.rank),
            "" if c.node is None else str(c.node),
            c.host or "",
        ).inc()
        if last_advance is not None:
            self._pending.append(_Pending(incident.key, last_advance, incident.detected_at))
        return True

    def recovered(self, at: float) -> None:
        """The job trains again since ``at`` (unix seconds of the first new heartbeat): the
        pending incidents are over."""
        pending, self._pending = sorted(self._pending, key=lambda p: p.detected_at), []
        # Several disruptions before the job trained again (a crash, then its restart stuck at
        # startup) share the stall: each costs from its start to the next one's detection, so
        # their lost seconds add up to the stall once, not once each.
        starts = [pending[0].last_advance] if pending else []
        starts += [max(p.detected_at, starts[0]) for p in pending[1:]]
        for p, start, end in zip(pending, starts, [*starts[1:], at]):
            lost = round(max(0.0, end - start), 3)
            try:
                self.incidents.update(p.key, recovered_at=at, lost_seconds=lost)
            except OSError as exc:
                log.warning("torchvitals supervise: cannot update incident %s: %s", p.key, exc)
                continue
            log.info(
                "torchvitals supervise: incident %s recovered: the job trains again after "
                "%.1f s lost",
                p.key,
                lost,
            )

    def close(self) -> None:
        self.timeline.close()
