"""torchrun's worker groups within one attempt, told from the heartbeats: the first group, its
death while the launcher runs, the restarted group (a generation: the incidents' ``-r<n>``),
and the first heartbeat that says the job trains again. Fake pids and clock.

python -m pytest tests/unit/test_worker_groups.py
"""

from __future__ import annotations

from torchvitals.protocol import TRAIN, RankBeat
from torchvitals.supervisor.worker_groups import WorkerGroups


def beats(pids: dict[int, int], t: float, step: int = 5, phase: str = TRAIN) -> dict:
    return {r: RankBeat(rank=r, step=step, time=t, phase=phase, pid=p) for r, p in pids.items()}


def test_a_restarted_group_is_a_new_generation_and_its_first_heartbeat_the_recovery():
    alive = {11, 12}
    groups = WorkerGroups(alive=alive.__contains__, wall=lambda: 500.0)
    assert groups.follow(beats({0: 11}, 100.0)) == (100.0, False)  # rank 0 first
    assert groups.follow(beats({0: 11, 1: 12}, 101.0)) == (101.0, False)  # rank 1: same group
    assert (groups.generation, groups.current) == (0, 0)
    assert groups.follow(beats({0: 11, 1: 12}, 102.0)) == (None, False)
    alive.clear()  # rank 1 exits 13, torchrun stops rank 0
    assert groups.follow(beats({0: 11, 1: 12}, 102.0)) == (None, True)
    assert (groups.dead_at, groups.generation, groups.current) == (500.0, 0, 1)
    alive.update({21, 22})  # torchrun's restart: rank 0 beats first under a new pid
    assert groups.follow(beats({0: 21, 1: 12}, 130.0, step=0)) == (130.0, False)
    assert (groups.dead_at, groups.generation, groups.current) == (None, 1, 1)
    assert groups.follow(beats({0: 21, 1: 22}, 131.0, step=0)) == (131.0, False)
    assert groups.generation == 1  # rank 1's new pid joins the same group


def test_a_rank_under_a_new_pid_is_a_new_group_even_if_the_old_one_was_never_seen_dead():
    groups = WorkerGroups(alive=lambda pid: True, wall=lambda: 0.0)
    groups.follow(beats({0: 11, 1: 12}, 1.0))
    groups.follow(beats({0: 21, 1: 12}, 9.0))
    assert groups.generation == 1
    groups.follow(beats({0: 21, 1: 22}, 9.5))  # the rest of the same restart
    assert groups.generation == 1
