"""The watchdog's checkpoint group, on a real one-rank gloo group (gloo opens a socket on
127.0.0.1, so this is not a unit test): made once, remade after the default group is, released
at exit.

    python -m pytest tests/integration/test_checkpoint_groups.py
"""

from __future__ import annotations

import pytest


def test_the_checkpoint_group_is_made_once_and_follows_the_default_group():
    import torch.distributed as dist

    from torchvitals.agent.recover.groups import CheckpointGroups

    groups = CheckpointGroups()
    assert groups.get(None) is None, "a single process needs none"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first = groups.get(None)
        assert groups.get(None) is first and groups.get(dist.group.WORLD) is first
        dist.destroy_process_group()  # every group goes, ours with it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        second = groups.get(None)
        assert second is not first and dist.get_backend(second) == "gloo"
        groups.close()  # what the process does at exit
        with pytest.raises(ValueError):
            dist.get_backend(second)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
