"""The goodput accounting over record folders written by the real writers (StepTimeline,
SupervisorTimeline) at explicit times, every figure checked against a reference computed by
hand from the rules in records/goodput.py.

    python -m pytest tests/unit/test_goodput.py -q
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support.goodput_jobs import crash_then_rollback

from torchvitals.records.goodput import CAUSES, Accountant, GoodputError, account
from torchvitals.records.incidents import Culprit, Incident, IncidentLog
from torchvitals.records.timeline import StepTimeline, SupervisorTimeline


def adds_up(g) -> None:
    """Productive plus every cause of badput is the wall time (microsecond sums, so exact up to
    the one division that turns them into seconds)."""
    assert set(g.badput) == set(CAUSES)
    assert g.productive_seconds + sum(g.badput.values()) == pytest.approx(g.wall_seconds, abs=1e-6)
    assert g.goodput == pytest.approx(g.productive_seconds / g.wall_seconds)


def badput(**seconds: float) -> dict[str, float]:
    """Every cause, those not named at 0."""
    return {cause: pytest.approx(seconds.get(cause, 0.0), abs=1e-6) for cause in CAUSES}


def test_a_crash_and_a_rollback_split_the_wall_clock_as_computed_by_hand(tmp_path):
    crash_then_rollback(tmp_path)
    g = account(tmp_path)
    adds_up(g)
    assert (g.started_at, g.ended_at, g.wall_seconds) == (1000, 1091, 91)
    # Attempt 1: 10 steps x 1.8 s of work, less step 5's 0.5 s save. Attempt 2: steps 11-15
    # and 16-20 are new, 5 x 1.8 s each.
    assert g.productive_seconds == pytest.approx(17.5 + 9 + 9)
    assert g.badput == badput(
        peers=2 + 1,
        unattributed=1,  # wait end 1002 -> attempt start 1003
        startup=7 + 3.5,
        checkpoint=0.5 + 1.5 + 1,  # a save, a load, a restore
        detection=6,  # last step 1030 -> detected 1036
        restart=2 + 1,  # detected -> attempt end 1038, -> next wait 1039
        data_wait=0.2 * (10 + 10 + 8),
        lost_progress=5 * 1.8 + 2 + 3 * 1.8,  # 6-10 redone, the rollback, 13-15 redone
        teardown=6 + 1,  # last step 1084 -> attempt end 1090 -> supervisor's end 1091
    )
    assert (g.attempts, g.processes, g.steps, g.last_step) == (2, 2, 28, 20)
    assert g.problems == ()


def test_each_incident_costs_its_records_seconds_or_its_disruptions(tmp_path):
    crash_then_rollback(tmp_path)
    log = IncidentLog(tmp_path)
    common = {"culprit": Culprit(rank=1, node=0), "cause": "x"}
    log.record(
        Incident(kind="crash", key="crash-a0001", step=10, detected_at=1036, attempt=1, **common)
    )
    log.record(
        Incident(
            kind="nonfinite",
            key="nonfinite-a0002-s00000016",
            step=16,
            detected_at=1068,
            attempt=2,
            **common,
        )
    )
    log.record(
        Incident(
            kind="straggler",
            key="straggler-a0002-r1-s00000013",
            step=13,
            detected_at=1075,
            lost_seconds=4.0,
            attempt=2,
            **common,
        )
    )
    log.record(
        Incident(
            kind="loss_spike",
            key="loss_spike-a0001-s00000004",
            step=4,
            detected_at=1018,
            attempt=1,
            **common,
        )
    )
    costs = {i.key: i.lost_seconds for i in account(tmp_path).incidents}
    assert costs == {
        # From the last step (1030) until a step is new again (step 11 starts at 1055).
        "crash-a0001": pytest.approx(25.0),
        # From the rollback's start (1065) until step 16 starts again (1074).
        "nonfinite-a0002-s00000016": pytest.approx(9.0),
        "straggler-a0002-r1-s00000013": 4.0,  # the record's own figure
        "loss_spike-a0001-s00000004": None,  # nothing was lost to it
    }


def torchrun_restart(folder: Path, *, node0: bool = True) -> None:
    """One attempt whose workers torchrun restarted once (a new rank-0 process, resumed from
    step 3); node 1's supervisor saw the same attempt from its own clock."""
    if node0:
        sup = SupervisorTimeline(folder, node=0)
        sup.waited(1, start=2000, end=2001)
        sup.attempt(1, start=2001, end=2020, reason="exit", status=0)
        sup.ended(at=2020.5, code=0)
    other = SupervisorTimeline(folder, node=1)
    other.waited(1, start=1990, end=2001)
    other.attempt(1, start=2001.2, end=2020, reason="exit", status=0)
    old = StepTimeline(folder, attempt=1, pid=7)
    old.start(at=2005, resumed=0)
    for s in range(1, 6):
        old.step(s, end=2005 + s, seconds=1)
    new = StepTimeline(folder, attempt=1, pid=8)
    new.start(at=2014, resumed=3, load_seconds=0.5)
    for s in range(4, 9):
        new.step(s, end=2014 + s - 3, seconds=1)


def test_torchrun_restarting_its_workers_is_restart_and_node_0_is_the_clock(tmp_path):
    torchrun_restart(tmp_path)
    g = account(tmp_path)
    adds_up(g)
    assert (g.started_at, g.wall_seconds) == (2000, 20.5)  # node 1's earlier wait is not the job's
    assert g.productive_seconds == pytest.approx(5 + 3)  # steps 1-5, then 6-8
    assert g.badput == badput(
        peers=1,
        startup=4,  # 2001 -> 2005
        restart=3.5,  # step 5's end 2010 -> the new process's load starts 2013.5
        checkpoint=0.5,
        lost_progress=2,  # 4, 5 again
        teardown=1 + 0.5,
    )
    assert (g.attempts, g.processes, g.steps, g.last_step) == (1, 2, 10, 8)
    IncidentLog(tmp_path).record(
        Incident(
            kind="crash",
            key="crash-a0001",
            step=5,
            culprit=Culprit(rank=2),
            cause="x",
            detected_at=2011,
            attempt=1,
        )
    )
    (cost,) = account(tmp_path).incidents
    assert cost.lost_seconds == pytest.approx(3.5 + 0.5 + 2)  # 2010 -> step 6 starts at 2016


def test_without_node_0_another_nodes_supervisor_is_the_clock(tmp_path):
    torchrun_restart(tmp_path, node0=False)
    g = account(tmp_path)
    adds_up(g)
    assert (g.started_at, g.ended_at) == (1990, 2020)
    assert g.productive_seconds == pytest.approx(8)
    assert g.badput == badput(
        peers=11,
        unattributed=0.2,  # its wait ended at 2001, its attempt started at 2001.2
        startup=3.8,
        restart=3.5,
        checkpoint=0.5,
        lost_progress=2,
        teardown=1,  # no end line
    )


def unsupervised(folder: Path) -> tuple[StepTimeline, StepTimeline]:
    """No supervisor: a run, and the same run started again by hand from its checkpoint."""
    first = StepTimeline(folder, pid=1)
    first.start(at=3010, resumed=0, load_seconds=2)
    for s in range(1, 5):
        first.step(s, end=3010 + 2.5 * s, seconds=2.5, data_wait=0.5, checkpoint=1.0 * (s == 2))
    second = StepTimeline(folder, pid=2)
    second.start(at=3030, resumed=2, load_seconds=1)
    for s in range(3, 7):
        second.step(s, end=3030 + 2 * (s - 2), seconds=2)
    return first, second


def test_without_supervisors_the_step_files_are_the_clock(tmp_path):
    unsupervised(tmp_path)
    g = account(tmp_path)
    adds_up(g)
    # From the first load's start (3010 - 2) to the last step (3038).
    assert (g.started_at, g.ended_at, g.wall_seconds) == (3008, 3038, 30)
    assert g.productive_seconds == pytest.approx(4 * 2 - 1 + 2 * 2)
    assert g.badput == badput(
        checkpoint=2 + 1 + 1, data_wait=4 * 0.5, restart=3029 - 3020, lost_progress=2 * 2
    )
    assert (g.attempts, g.processes, g.steps, g.last_step) == (1, 2, 8, 6)


def test_bad_lines_are_named_and_skipped_and_a_cut_last_line_is_dropped_silently(tmp_path):
    first, second = unsupervised(tmp_path)
    clean = account(tmp_path)
    first.step(5, end=3021, seconds=float("nan"))
    first.step(5, end=3022, seconds=-1)
    first.step(5, end=3019, seconds=1)  # ends before the previous line
    with open(first._lines.path, "a", encoding="utf-8") as f:
        f.write("garbage\n[1, 2]\n" + json.dumps({"e": "step", "s": "7", "t": 3023, "d": 1}) + "\n")
        f.write(json.dumps({"e": "beat", "t": 3024}) + "\n")
    with open(second._lines.path, "a", encoding="utf-8") as f:
        f.write('{"e":"step","s":7,"t":30')  # a crash mid-line
    sup = tmp_path / "goodput" / "supervisor-node0.jsonl"
    sup.write_text(json.dumps({"e": "attempt", "a": 0, "t0": 5, "t1": 4, "status": 0}) + "\n")
    g = account(tmp_path)
    assert (g.wall_seconds, g.productive_seconds, g.badput) == (
        clean.wall_seconds,
        clean.productive_seconds,
        clean.badput,
    )
    steps, sup_name = str(first._lines.path), str(sup)
    expected = [
        f"{steps}:6: d: not finite",
        f"{steps}:7: d: a negative duration",
        f"{steps}:8: ends before the previous line",
        f"{steps}:9: not JSON",
        f"{steps}:10: not a JSON object",
        f"{steps}:11: s: expected a step number",
        f"{steps}:12: not a step file's record",
        f"{sup_name}:1: t1 before t0",
    ]
    assert len(g.problems) == len(expected), g.problems
    for problem, start in zip(g.problems, expected, strict=True):
        assert problem.startswith(start), (problem, start)
    assert not any("p2.jsonl" in p for p in g.problems)


def test_time_two_records_claim_is_unattributed_and_the_parts_still_add_up(tmp_path):
    sup = SupervisorTimeline(tmp_path)
    steps = StepTimeline(tmp_path, attempt=1, pid=1)
    sup.waited(1, start=0, end=1)
    steps.start(at=1, resumed=0)
    for s in range(1, 11):
        steps.step(s, end=1 + s, seconds=1)
    # The supervisor's clock ran 2 s behind: its attempt ended before the last step, and its
    # next wait (6 -> 10) overlaps the attempt's steps 6 to 9 by 3 s.
    sup.attempt(1, start=1, end=9, reason="exit", status=1, detected=8)
    sup.waited(2, start=8, end=12)
    g = account(tmp_path)
    adds_up(g)
    assert g.wall_seconds == 12
    assert g.badput == badput(peers=1 + 1, unattributed=3)  # 10 -> 12 alone is peers
    assert g.productive_seconds == pytest.approx(10 - 3)


def test_an_empty_folder_is_an_error_naming_it(tmp_path):
    with pytest.raises(GoodputError, match=str(tmp_path / "goodput")):
        account(tmp_path)
    (tmp_path / "goodput").mkdir()
    (tmp_path / "goodput" / "steps-a0000-p1.jsonl").write_text('{"e":"st')
    with pytest.raises(GoodputError, match="no goodput records"):
        account(tmp_path)


def test_read_on_as_records_land_equals_reading_afresh_and_productive_time_only_grows(tmp_path):
    """What the supervisor's exporter does: one Accountant, asked again after every record of
    the crash-and-rollback job lands, reading each file on from where it stopped."""
    crash_then_rollback(tmp_path / "whole")
    lines = []
    for path in sorted((tmp_path / "whole" / "goodput").iterdir()):
        for line in path.read_text().splitlines(keepends=True):
            lines.append((json.loads(line).get("t", json.loads(line).get("t1")), path.name, line))
    # Replayed in time order: a supervisor's attempt line lands when the attempt ends.
    lines.sort(key=lambda x: (x[0], x[1].startswith("supervisor")))
    live = tmp_path / "live"
    (live / "goodput").mkdir(parents=True)
    accountant = Accountant(live)
    productive = 0.0
    for _, name, line in lines:
        with open(live / "goodput" / name, "a", encoding="utf-8") as f:
            f.write(line)
        now, afresh = accountant.account(), account(live)
        assert now.to_dict() == afresh.to_dict()
        adds_up(now)
        assert now.productive_seconds >= productive
        productive = now.productive_seconds
    assert now.to_dict() == account(tmp_path / "whole").to_dict()


class TickingClock:
    """Unix time that passes when the test sleeps, and by a microsecond at each reading (as
    reading a real clock does), so records written back to back leave a little unattributed."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def time(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_records_written_as_the_agent_and_the_supervisor_write_them_leave_little_unattributed(
    tmp_path,
):
    """The writers called as the agent and the supervisor call them: a supervised attempt that
    crashes and one that resumes. What no rule covers is the time between records written back
    to back."""
    clock = TickingClock()
    sup = SupervisorTimeline(tmp_path)
    resumed = 0
    for attempt in (1, 2):
        start = clock.time()
        clock.sleep(0.02)
        sup.waited(attempt, start=start, end=clock.time())
        began = clock.time()
        clock.sleep(0.03)  # the launcher, the imports, the process group
        steps = StepTimeline(tmp_path, attempt=attempt)
        steps.start(at=clock.time(), resumed=resumed, load_seconds=0.0)
        last = clock.time()
        for s in range(resumed + 1, resumed + 16):
            fetch = clock.time()
            clock.sleep(0.002)
            waited = clock.time() - fetch
            clock.sleep(0.01)
            end = clock.time()
            steps.step(s, end=end, seconds=end - last, data_wait=waited)
            last = end
        steps.close()
        if attempt == 1:
            clock.sleep(0.05)  # the crash, until the supervisor sees it
            detected = clock.time()
            clock.sleep(0.02)
            sup.attempt(
                attempt, start=began, end=clock.time(), reason="exit", status=1, detected=detected
            )
            resumed = 10
        else:
            clock.sleep(0.01)
            sup.attempt(attempt, start=began, end=clock.time(), reason="exit", status=0)
    sup.ended(at=clock.time(), code=0)
    g = account(tmp_path)
    adds_up(g)
    # A few microseconds between records written back to back, of about 1.5 s.
    assert 0 < g.badput["unattributed"] < 1e-4 * g.wall_seconds, g.render()
    assert g.badput["lost_progress"] > 0 and g.last_step == 25
    assert all(g.badput[c] > 0 for c in ("peers", "startup", "detection", "restart", "data_wait"))
    assert math.isclose(g.goodput, g.productive_seconds / g.wall_seconds)


def test_a_skipped_update_is_its_own_badput_and_still_counts_as_done(tmp_path):
    """A step whose update every rank dropped (a non-finite step, a one-step outlier): its work
    is skipped_update, not productive; the next step number is new work, not done again."""
    steps = StepTimeline(tmp_path, pid=1)
    steps.start(at=100, resumed=0)
    for s in range(1, 11):
        action = "skip" if s in (4, 7) else "step"
        steps.step(s, end=100 + s, seconds=1, data_wait=0.25, action=action)
    g = account(tmp_path)
    adds_up(g)
    assert g.productive_seconds == pytest.approx(8 * 0.75)
    assert g.badput == badput(skipped_update=2 * 0.75, data_wait=10 * 0.25)
    assert (g.steps, g.last_step) == (10, 10)


def test_a_steps_rerun_is_its_own_badput(tmp_path):
    """A suspect step computed once more (a transient fault's re-run): its ``r`` seconds are
    rerun, the rest of that skipped step skipped_update; a line without ``r`` has none."""
    steps = StepTimeline(tmp_path, pid=1)
    steps.start(at=100, resumed=0)
    for s in range(1, 6):
        skip = s == 3
        steps.step(s, end=100 + s, seconds=1, action="skip" if skip else "step", rerun=0.4 * skip)
    g = account(tmp_path)
    adds_up(g)
    assert g.badput == badput(skipped_update=0.6, rerun=0.4)
    assert "r" not in (tmp_path / "goodput" / "steps-a0000-p1.jsonl").read_text().splitlines()[1]
