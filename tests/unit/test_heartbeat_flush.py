"""A step the heartbeat's interval held back is still written once the interval has passed, so
a job that hangs right after it shows the step it reached (a hang incident names that step).

    python -m pytest tests/unit/test_heartbeat_flush.py -q
"""

from __future__ import annotations

import json
import time

from torchvitals.agent.recover.heartbeat import Heartbeat
from torchvitals.protocol import heartbeat_path, read_rank_beats


def written_step(folder, rank: int = 2) -> int:
    return json.loads(heartbeat_path(folder, rank).read_text())["step"]


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_held_back_step_is_written_after_the_interval(tmp_path):
    beat = Heartbeat(tmp_path, rank=2, interval_s=0.2, flush=True)
    beat.beat(11)
    for step in (12, 13, 14):  # within the interval: held back
        beat.beat(step)
    assert written_step(tmp_path) == 11
    assert wait_for(lambda: written_step(tmp_path) == 14)  # then the job "hangs": no more beats
    assert read_rank_beats(tmp_path)[2].step == 14
    beat.close()


def test_nothing_is_written_after_close(tmp_path):
    beat = Heartbeat(tmp_path, rank=2, interval_s=60.0, flush=True)
    beat.beat(5)
    beat.beat(6)  # held back, then closed before the timer fires
    timer = beat._timer
    assert timer is not None
    beat.close()
    timer.join(timeout=5)  # cancelled: its thread ends without firing
    assert not timer.is_alive() and written_step(tmp_path) == 5
    beat._flush_held()  # a timer that fired as close() ran: it writes nothing either
    assert written_step(tmp_path) == 5


def test_without_flush_a_held_back_step_stays_held(tmp_path):
    beat = Heartbeat(tmp_path, rank=2, interval_s=60.0)
    beat.beat(5)
    beat.beat(6)
    assert beat._timer is None  # no timer that could write it later
    assert written_step(tmp_path) == 5
    beat.close()


def test_a_flushed_step_carries_the_time_it_was_reached_not_the_flush_time(tmp_path):
    # The supervisor's hang clock counts from a beat's time: a flush stamped with its own time
    # would move the last advance up to an interval past a rank that stopped right after it.
    clock = [100.0]
    beat = Heartbeat(tmp_path, rank=2, interval_s=0.2, clock=lambda: clock[0], flush=True)
    beat.beat(11)
    clock[0] = 100.05
    beat.beat(12)  # held back; reached at 100.05
    clock[0] = 100.15
    beat.beat(12)  # the same step again: not a new advance
    clock[0] = 100.9  # the timer fires later
    assert wait_for(lambda: written_step(tmp_path) == 12)
    assert read_rank_beats(tmp_path)[2].time == 100.05
    beat.close()
