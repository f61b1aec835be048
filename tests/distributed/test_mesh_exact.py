"""HSDP and FSDP x tensor parallel on a 2 x 2 mesh of 4 gloo ranks: every signal exact against a
single-process reference fed the same global batch, and the same report on every rank."""

import pytest
from mesh_ranks import ddp_refused, exact
from support.meshes import LAYOUTS, WORLD
from support.world import run_world


@pytest.mark.parametrize("kind", LAYOUTS)
def test_signals_on_a_2d_mesh_match_the_single_process_reference(kind):
    reports = run_world(exact, kind, world=WORLD, timeout=360)
    for rank, theirs in enumerate(reports[1:], start=1):
        assert theirs == reports[0], f"{kind}: rank {rank}'s reports differ from rank 0's"
    assert [r["action"] for r in reports[0]] == ["step"] * 5 + ["skip"]


def test_ddp_over_a_tensor_parallel_model_is_refused_at_watch_on_every_rank():
    """DDP hands the agent local pieces that look like whole parameters and reduces over its
    dp group only: each tp rank would judge alone, so the layout is refused, naming the fix."""
    messages = run_world(ddp_refused, world=WORLD, timeout=360)
    assert len(set(messages)) == 1, messages
    assert "tensor-parallel" in messages[0] and "fully_shard" in messages[0], messages[0]
