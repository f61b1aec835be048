"""Goodput record folders written by the real writers at explicit times, for the accounting's
tests (unit) and the command's (integration). Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from torchvitals.records.timeline import StepTimeline, SupervisorTimeline


def crash_then_rollback(folder: Path) -> None:
    """Two attempts on one node. Attempt 1 trains steps 1-10 and crashes; attempt 2 resumes from
    step 5's checkpoint, redoes 6-10, rolls back at step 16 to step 12, redoes 13-15, finishes
    at step 20."""
    sup = SupervisorTimeline(folder, node=0)
    sup.waited(1, start=1000, end=1002)  # peers 2
    first = StepTimeline(folder, attempt=1, pid=100)
    first.start(at=1010, resumed=0)  # startup 1003 -> 1010 (the 1 s from the wait is a gap)
    for s in range(1, 11):  # 2 s each, 0.2 s data wait, step 5 saves for 0.5 s
        first.step(s, end=1010 + 2 * s, seconds=2, data_wait=0.2, checkpoint=0.5 * (s == 5))
    first.close()
    sup.attempt(1, start=1003, end=1038, reason="exit", status=1, detected=1036)
    sup.waited(2, start=1039, end=1040)  # restart 1038 -> 1039, peers 1
    second = StepTimeline(folder, attempt=2, pid=200)
    second.start(at=1045, resumed=5, load_seconds=1.5)  # startup 1040 -> 1043.5, load 1.5
    t = 1045.0
    for s in range(6, 16):
        t += 2
        second.step(s, end=t, seconds=2, data_wait=0.2)
    t += 3  # 1068: the rollback, 1 s of it the restore
    second.step(16, end=t, seconds=3, checkpoint=1, action="rollback")
    for s in range(13, 21):
        t += 2
        second.step(s, end=t, seconds=2, data_wait=0.2)
    assert t == 1084
    second.close()
    sup.attempt(2, start=1040, end=1090, reason="exit", status=0)
    sup.ended(at=1091, code=0)
    sup.close()
