"""From a hang, a crash or a lost node to its incident: this node's findings, the other nodes'
(through the store), the culprit, the record.

    localizer = Localizer(config, peers, book, node=0, host="h")
    incident = localizer.hang(attempt, key, witness, clock=hang, detected_at=t)   # before the stop
    incident = localizer.crash(attempt, key, witness, step=41, detected_at=t, ...)
    localizer.lost(attempt, order, detected_at=t, last_advance=beat.time)
    localizer.answer(attempt, witness)           # each poll: findings other nodes asked for

Many nodes see the same hang or crash; one gathers every node's findings and decides, the
others take its verdict (``peers.settle``), so each disruption is decided once.

Keys name the disruption, the same on every node (``incident_key``), so the nodes that see the
same one write one record: ``hang-a0002`` (a hang of attempt 2), ``crash-a0002-r1`` (a crash of the
workers torchrun started at its first restart within attempt 2), ``node_lost-a0002-n1``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..records.incidents import Culprit, Incident
from ..records.vocabulary import CRASH, HANG, NODE_LOST
from .blame import BEAT_SLACK_S, Blame, blame_crash, blame_hang, union
from .disruptions import Disruptions
from .hang_clock import RESTART, STARTUP, HangClock
from .options import SupervisorConfig
from .orders import NodesLost
from .peers import Gathered, Peers
from .rank_findings import NodeFindings
from .store_schema import NodeState
from .witness import Witness

log = logging.getLogger("torchvitals.supervisor")


def incident_key(kind: str, attempt: int, generation: int = 0) -> str:
    """``hang-a0002``, or ``crash-a0002-r1`` for the workers of torchrun's first restart within
    the attempt (``generation``: how many times torchrun restarted them before)."""
    return f"{kind}-a{attempt:04d}" + (f"-r{generation}" if generation else "")


def generation_of(key: str) -> int:
    """The worker generation a hang's or a crash's key names (0: the attempt's first)."""
    last = key.rsplit("-", 1)[-1]
    return int(last[1:]) if last[:1] == "r" and last[1:].isdigit() else 0


class Localizer:
    """Names the culprit of each disruption this node sees and records it.

    Args:
        config: ``restart_floor_s``, ``restart_factor`` (named in a stuck restart's evidence).
        peers: the other nodes (their findings).
        book: where incidents are written.
        node, host: this node.
        wall: unix seconds (the records' times, for people).
        clock: monotonic seconds, the witness's (when another node's ask was seen).
    """

    def __init__(
        self,
        config: SupervisorConfig,
        peers: Peers,
        book: Disruptions,
        *,
        node: int,
        host: str,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.peers, self.book = config, peers, book
        self.node, self.host, self._wall, self._clock = node, host, wall, clock
        # Nodes take their heartbeat ages as of the ask (or of seeing it): moments a store
        # poll and a watch poll apart at most, on top of the heartbeats' own slack.
        self._slack_s = BEAT_SLACK_S + (
            config.store_poll_s + config.poll_s if config.nnodes > 1 else 0.0
        )

    def hang(
        self, attempt: int, key: str, witness: Witness, *, clock: HangClock, detected_at: float
    ) -> Incident:
        """A hang seen here: every node's ranks looked at (before anything is stopped), the
        culprit named, the incident recorded, once for every node that saw it (the first to
        claim it decides; the others take its verdict). A node that never answers because it
        is gone (its lease expired before the ask, or since) is the cause: the ranks here hung
        in collectives waiting for its ranks, and the incident is that node's loss, whichever
        timer fired first."""
        step = clock.beat.step if clock.beat is not None else None
        last_advance = clock.beat.time if clock.beat is not None else None

        def decide(gathered: Gathered) -> Incident:
            ranks, _ = union(gathered.findings)
            blame = blame_hang(ranks, slack_s=self._slack_s)
            now_age = detected_at - (last_advance if last_advance is not None else detected_at)
            evidence = dict(blame.evidence)
            cause = blame.cause
            phase = clock.phase()
            if phase in (STARTUP, RESTART):
                evidence.update(_startup_evidence(self.config, clock))
                if phase == RESTART:
                    cause = (
                        f"startup after restart took more than {clock.timeout():.1f} s (the "
                        f"first start took {clock.first_start_s or 0:.1f} s)"
                        + ("" if blame.rule == "none" else f"; {blame.cause}")
                    )
            evidence.update(phase=phase, timeout_s=round(clock.timeout(), 3))
            if clock.beat is not None:
                evidence["last_heartbeat_age_s"] = round(now_age, 3)
            return self._incident(HANG, key, attempt, blame, cause, evidence, step, detected_at)

        return self._settle(
            attempt,
            witness.findings(key),
            decide,
            step=step,
            detected_at=detected_at,
            last_advance=last_advance,
            seen=f"the ranks here hung waiting for its ranks ({key})",
        )

    def crash(
        self,
        attempt: int,
        key: str,
        witness: Witness,
        *,
        step: int | None,
        detected_at: float,
        last_advance: float | None,
        launcher_status: int | None,
    ) -> Incident:
        """A crash seen here (the launcher exited, or torchrun's workers all died): the rank that
        died first across nodes, with its exit status, decided once for every node that saw
        it. A node that never answers because it is gone (its lease expired meanwhile) is the
        cause: its ranks died with it, and this node's of their failed collectives; the
        incident is then that node's loss."""

        def decide(gathered: Gathered) -> Incident:
            _, deaths = union(gathered.findings)
            blame = blame_crash(deaths)
            if blame is None:
                status = "" if launcher_status is None else f" with status {launcher_status}"
                blame = Blame(
                    Culprit(node=self.node, host=self.host),
                    f"the launcher exited{status} and no rank was seen dying (none had written "
                    "a heartbeat, or every rank ended cleanly)",
                    "none",
                    {"rule": "none"},
                )
            evidence = {**blame.evidence, "launcher_status": launcher_status}
            return self._incident(
                CRASH, key, attempt, blame, blame.cause, evidence, step, detected_at
            )

        return self._settle(
            attempt,
            witness.findings(key),
            decide,
            step=step,
            detected_at=detected_at,
            last_advance=last_advance,
            seen=f"its ranks' collectives failed here ({key})",
        )

    def _settle(
        self,
        attempt: int,
        mine: NodeFindings,
        decide: Callable[[Gathered], Incident],
        *,
        step: int | None,
        detected_at: float,
        last_advance: float | None,
        seen: str,
    ) -> Incident:
        """The disruption's incident, decided here (``decide`` on every node's findings; a
        node gone meanwhile is its cause, ``seen`` there, and each such node an incident) or by
        the node that claimed it first (its records then written here too: the same, which a
        shared folder keeps once); the first."""

        def decide_here(gathered: Gathered) -> list[Incident]:
            if gathered.lost:
                return self._lost(
                    attempt,
                    gathered.lost,
                    gathered.published_at,
                    step=step,
                    detected_at=detected_at,
                    last_advance=last_advance,
                    seen=seen,
                )
            incident = decide(gathered)
            self.book.record(incident, last_advance=last_advance)
            return [incident]

        settled = self.peers.settle(attempt, mine, decide_here, until_lost=True)
        if settled.by != self.node:
            log.info(
                "torchvitals supervise: %s decided by node %d: %s",
                settled.incidents[0].key,
                settled.by,
                settled.incidents[0].cause,
            )
            for incident in settled.incidents:
                self.book.record(incident, last_advance=last_advance)
        return settled.incidents[0]

    def lost(
        self, attempt: int, order: NodesLost, *, detected_at: float, last_advance: float | None
    ) -> list[Incident]:
        """The lost nodes of ``order``, one incident each (the node alone: no rank)."""
        return self._lost(
            attempt,
            order.lost,
            order.published_at,
            step=order.step,
            detected_at=detected_at,
            last_advance=last_advance,
            seen="it stopped renewing its lease",
        )

    def _lost(
        self,
        attempt: int,
        lost: tuple[NodeState, ...],
        published_at: tuple[float | None, ...],
        *,
        step: int | None,
        detected_at: float,
        last_advance: float | None,
        seen: str,
    ) -> list[Incident]:
        """One incident per lost node, at ``step``: the step this node's ranks reached, in
        synchronous training the lost node's too (its own published step lags)."""
        found = []
        at = published_at or (None,) * len(lost)
        for state, published in zip(lost, at, strict=False):
            reached = step if step is not None else state.step
            incident = Incident(
                kind=NODE_LOST,
                key=f"{incident_key(NODE_LOST, attempt)}-n{state.node}",
                step=reached,
                culprit=Culprit(node=state.node, host=None if state.host == "?" else state.host),
                cause=(
                    f"{state.name()} was lost at step {reached}: {seen} (it last published "
                    f"step {state.step})"
                ),
                evidence={
                    "survivor_step": step,
                    "survivor_node": self.node,
                    "last_published_step": state.step,
                    "last_published_at": published,
                    "supervisor_pid": state.pid or None,
                    "node_ttl_s": self.config.node_ttl_s,
                },
                detected_at=detected_at,
                localized_at=self._wall(),
                attempt=attempt,
                writer=self.book.writer,
            )
            self.book.record(incident, last_advance=last_advance)
            found.append(incident)
        return found

    def answer(self, attempt: int, witness: Witness, *, now: bool = False) -> None:
        """Publish this node's findings for every incident another node asked about, their
        heartbeat ages as of the moment the ask was seen here."""
        wanted = self.peers.wanted(attempt, now=now)
        seen = self._clock()
        for key in wanted:
            log.info("torchvitals supervise: node findings for %s asked; answering", key)
            self.peers.answer(attempt, witness.findings(key).as_of(seen))

    def _incident(
        self,
        kind: str,
        key: str,
        attempt: int,
        blame: Blame,
        cause: str,
        evidence: dict,
        step: int | None,
        detected_at: float,
    ) -> Incident:
        """The record; localized now when a culprit was named (a node, at least)."""
        return Incident(
            kind=kind,
            key=key,
            step=step,
            culprit=blame.culprit,
            cause=cause,
            evidence=evidence,
            detected_at=detected_at,
            localized_at=self._wall() if blame.culprit != Culprit() else None,
            attempt=attempt,
            writer=self.book.writer,
        )


def _startup_evidence(config: SupervisorConfig, clock: HangClock) -> dict:
    if clock.phase() == STARTUP:
        return {"startup_timeout_s": config.startup_timeout_s}
    return {
        "stuck": "startup after restart",
        "bound_s": round(clock.restart_bound(), 3),
        "first_start_s": None if clock.first_start_s is None else round(clock.first_start_s, 3),
        "restart_floor_s": config.restart_floor_s,
        "restart_factor": config.restart_factor,
    }
