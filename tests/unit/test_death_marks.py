"""Each rank death a node sees is recorded in the job's store at once, in the order seen, by a
thread of its own: the store's revisions are the deaths' order across nodes, a slow store never
holds up the watch, and a crash's findings wait (boundedly) for their revisions. A fake store,
fake pids (ones that do not exist: gone before they are watched) and a fake clock.

python -m pytest tests/unit/test_death_marks.py
"""

from __future__ import annotations

import itertools
import threading

from torchvitals.protocol import TRAIN, RankBeat
from torchvitals.supervisor.death_marks import DeathMarks
from torchvitals.supervisor.deaths import DeathWatch
from torchvitals.supervisor.rank_findings import NodeFindings
from torchvitals.supervisor.witness import Witness

GONE_PIDS = (2**22 + 11, 2**22 + 12, 2**22 + 13)
"""Above Linux's largest pid (2**22): no process has them, so they are gone when watched."""


class Store:
    """Hands out revisions in the order of the writes, as etcd does; ``gate`` holds each write."""

    def __init__(self, first: int = 100) -> None:
        self.revision = itertools.count(first)
        self.written: list[tuple[int, int | None, int | None]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def mark(self, pid: int, rank: int | None, status: int | None) -> int | None:
        self.entered.set()
        self.gate.wait(30)
        self.written.append((pid, rank, status))
        return next(self.revision)


def test_deaths_are_recorded_in_the_order_seen_and_adding_never_waits_for_the_store():
    store = Store()
    store.gate.clear()  # the store hangs on the first write
    marks = DeathMarks(store.mark)
    marks.add(12, 2, 13)
    assert store.entered.wait(30)
    marks.add(13, 3, -15)  # returns at once though the first write is still held
    marks.add(12, 2, 13)  # a death is recorded once
    marks.add(10, 0, 1)
    assert marks.known() == {}
    store.gate.set()
    assert marks.revisions(wait_s=30) == {12: 100, 13: 101, 10: 102}
    assert store.written == [(12, 2, 13), (13, 3, -15), (10, 0, 1)]


def test_a_store_that_does_not_answer_leaves_the_rest_unordered_within_the_bound():
    store = Store()
    marks = DeathMarks(store.mark)
    marks.add(12, 2, 13)
    assert marks.revisions(wait_s=30) == {12: 100}
    store.gate.clear()
    ticks = itertools.count()
    slow = DeathMarks(store.mark, clock=lambda: float(next(ticks)))  # 1 s per look
    slow.add(13, 3, -15)
    assert slow.revisions(wait_s=3.0) == {}  # gave up after the bound, not after the store
    store.gate.set()
    assert slow.revisions(wait_s=30) == {13: 101}


def test_a_write_that_fails_is_left_out_and_the_next_ones_go_on():
    revisions = iter([None, 7])

    def mark(pid: int, rank: int | None, status: int | None) -> int | None:
        if pid == 11:
            raise OSError("store gone")
        return next(revisions)

    marks = DeathMarks(mark)
    for pid in (11, 12, 13):
        marks.add(pid, pid - 10, 1)
    assert marks.revisions(wait_s=30) == {13: 7}


def test_the_death_watch_tells_each_death_once():
    told: list[tuple[int, int | None, int | None]] = []
    watch = DeathWatch(clock=lambda: 50.0, on_death=lambda *death: told.append(death))
    try:
        watch.watch(GONE_PIDS[0], 1)
        watch.watch(GONE_PIDS[0], 1)
        assert told == [(GONE_PIDS[0], 1, None)]
        assert watch.deaths()[GONE_PIDS[0]].at == 50.0
    finally:
        watch.close()


def test_a_crash_s_findings_carry_each_death_s_revision(tmp_path):
    store = Store(first=40)
    witness = Witness(tmp_path, node=1, host="h1", stderr=None, probe_wait_s=0, mark=store.mark)
    try:
        beats = {
            r: RankBeat(rank=r, step=9, time=1.0, phase=TRAIN, pid=pid)
            for r, pid in zip((2, 3), GONE_PIDS[:2], strict=True)
        }
        witness.poll(beats)
        found = witness.findings("crash-a0001")
        assert {(d.rank, d.pid, d.revision) for d in found.deaths} == {
            (2, GONE_PIDS[0], 40),
            (3, GONE_PIDS[1], 41),
        }
        assert NodeFindings.from_json(found.to_json()).deaths == found.deaths
    finally:
        witness.close(0)
