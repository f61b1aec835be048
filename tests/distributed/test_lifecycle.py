"""Many ``watch()``/``close()`` cycles in one process never hang.

Six cycles on two gloo ranks with background checkpoints used to hang in most tries: each agent
made a gloo group for its writes and destroyed it at close, and the next agent's group over the
same ranks got the destroyed one's name, whose stale rendezvous keys its peers then read. The
group is now made once per process (``agent/recover/groups.py``) and reused.
"""

from __future__ import annotations

import pytest
from lifecycle_ranks import cycles
from support.world import run_world

CYCLES, STEPS = 6, 4


@pytest.mark.timeout(180)
def test_six_watch_close_cycles_with_checkpoints_on_two_ranks_finish(tmp_path):
    results = run_world(cycles, str(tmp_path), CYCLES, STEPS, timeout=120)
    assert results[0] == results[1], "the ranks disagree"
    runs = results[0]
    assert [r["resumed_from"] for r in runs] == [None] + [STEPS * c for c in range(1, CYCLES)]
    assert all(r["actions"] == ["step"] * STEPS for r in runs), runs
    for c, r in enumerate(runs):  # the save in flight at close() was finished and committed
        assert r["checkpointed"] == [STEPS * c + 2, STEPS * c + 4], r
        assert r["last_healthy"] == STEPS * (c + 1), r
    assert len({r["group"] for r in runs}) == 1, "every agent reuses the process's checkpoint group"
    assert (tmp_path / f"step-{STEPS * CYCLES:08d}").is_dir()
