"""A re-start stuck at startup is a hang with a learned bound: restart_factor x the job's first
start, at least restart_floor_s; the first start keeps the cold-start timeout. A fake clock.

python -m pytest tests/unit/test_restart_bound.py
"""

from __future__ import annotations

from collections import deque

from torchvitals.protocol import Beat
from torchvitals.supervisor.hang_clock import (
    CHECKPOINT,
    RESTART,
    STARTUP,
    TRAIN,
    HangClock,
)
from torchvitals.supervisor.options import SupervisorConfig

CONFIG = SupervisorConfig(
    startup_timeout_s=600, restart_floor_s=60, restart_factor=3, hang_timeout_s=30
)


def beat(step: int, pids=(11, 12), checkpointing=False) -> Beat:
    return Beat(step=step, time=1000.0 + step, checkpointing=checkpointing, pids=pids)


def test_the_first_start_has_the_cold_start_timeout_and_teaches_the_bound():
    clock = HangClock(CONFIG, deque(), now=0.0)
    assert (clock.phase(), clock.timeout()) == (STARTUP, 600)
    assert not clock.hung(599) and clock.hung(601)
    clock.observe(beat(0, checkpointing=True), now=40.0)  # the first heartbeat: 40 s to start
    assert clock.first_start_s == 40.0 and clock.phase() == CHECKPOINT
    assert clock.restart_bound() == 120.0  # 3 x 40 s, above the 60 s floor
    clock.observe(beat(1), now=41.0)
    assert (clock.phase(), clock.timeout()) == (TRAIN, 30)


def test_torchrun_restarting_its_workers_is_bounded_from_the_moment_they_are_gone():
    clock = HangClock(CONFIG, deque(), now=0.0)
    clock.observe(beat(0), now=10.0)  # a 10 s first start: the floor rules
    clock.observe(beat(25), now=200.0)
    clock.between_workers(True, now=205.0)  # every rank of the last beat gone: torchrun restarts
    assert (clock.phase(), clock.timeout()) == (RESTART, 60)
    clock.between_workers(True, now=230.0)  # still gone: the wait counts from the first sight
    assert clock.age(264.0) == 59.0 and not clock.hung(264.0)
    assert clock.hung(265.5)  # 60.5 s, not the 600 s cold-start timeout
    # The restarted workers' first heartbeat ends the re-start.
    clock.between_workers(False, now=250.0)
    clock.observe(beat(20, pids=(21, 22)), now=250.0)
    assert clock.phase() == TRAIN and not clock.hung(270.0)


def test_a_new_attempt_of_the_job_is_a_re_start_with_the_learned_bound():
    # The supervisor keeps the first start across attempts and gives it to the next one's clock.
    first = HangClock(CONFIG, deque(), now=0.0)
    first.observe(beat(0), now=25.0)
    again = HangClock(CONFIG, deque(), now=500.0, first_start_s=first.first_start_s)
    assert (again.phase(), again.timeout()) == (RESTART, 75.0)  # 3 x 25 s
    assert not again.hung(574.0) and again.hung(576.0)
    again.observe(beat(0), now=530.0)
    assert again.first_start_s == 25.0  # the job's first start, not this one


def test_the_bound_follows_the_config_fields():
    config = SupervisorConfig(restart_floor_s=5, restart_factor=2)
    clock = HangClock(config, deque(), now=0.0, first_start_s=1.0)
    assert clock.restart_bound() == 5.0
    assert HangClock(config, deque(), now=0.0, first_start_s=4.0).restart_bound() == 8.0
    assert SupervisorConfig.from_env(
        {
            "TORCHVITALS_SUPERVISOR_RESTART_FLOOR_S": "7",
            "TORCHVITALS_SUPERVISOR_RESTART_FACTOR": "4",
            "TORCHVITALS_SUPERVISOR_FINDINGS_WAIT_S": "2.5",
            "TORCHVITALS_SUPERVISOR_PROBE_WAIT_S": "0.5",
            "TORCHVITALS_SUPERVISOR_TEE_STDERR": "false",
        }
    ) == SupervisorConfig(
        restart_floor_s=7,
        restart_factor=4,
        findings_wait_s=2.5,
        probe_wait_s=0.5,
        tee_stderr=False,
    )
