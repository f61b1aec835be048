"""The nanoGPT-shaped loop examples/nanogpt_loop.py runs (tools.examples.nanogpt): hand-set LR,
accumulation, its own clipping, ``scaler.step(optimizer)``, random batches from the global RNG.
A batch of bad data (recognised by its content) breaks one step: exactly one rollback, the
batch is never drawn again, and the loop's hand-set LR keeps the back-off."""

from __future__ import annotations

import math

import pytest
import torch

from torchvitals.agent.tools.examples.nanogpt import Settings, get_lr, train


def _key(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.reshape(-1).tolist())


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_bad_random_batch_rolls_back_once_and_is_never_drawn_again(tmp_path, dtype):
    settings = Settings(out=str(tmp_path / dtype), max_iters=60, dtype=dtype)
    seen: list[torch.Tensor] = []
    bad: list[tuple[int, ...]] = []

    def corrupt(x: torch.Tensor) -> bool:
        # The 51st batch drawn (iteration 25, micro-batch 1) is the corrupt one, by its content.
        if len(seen) == 51 and not bad:
            bad.append(_key(x))
        return bool(bad) and _key(x) == bad[0]

    result = train(settings, corrupt=corrupt, seen=seen)
    drawn = [_key(x) for x in seen]
    assert bad and drawn.count(bad[0]) == 1, "the bad batch was drawn again after the rollback"
    assert len(result.rollbacks) == 1, result.rollbacks
    rollback = result.rollbacks[0]
    assert rollback.to_step == 20 and rollback.lr_scale == 0.5
    assert rollback.skipped is None  # nothing was skipped: the RNGs were re-seeded
    reports = result.reports
    assert [r.action for r in reports].count("rollback") == 1
    after = [(i, r) for i, r in enumerate(reports) if i > 25 and r.action == "step"]
    for i, r in after:  # the loop set get_lr(i) by hand; the step ran at half of it
        assert r.lr == [pytest.approx(0.5 * get_lr(i, settings))]
    assert math.isfinite(result.final_loss) and result.final_loss < 0.6 * result.first_loss
    assert result.iterations == 60 and result.steps == 60 - (26 - 20)


def test_without_the_rollback_the_same_loop_replays_nothing_and_trains(tmp_path):
    result = train(Settings(out=str(tmp_path), max_iters=40))
    assert not result.rollbacks and result.steps == 40
    assert result.final_loss < 0.6 * result.first_loss
