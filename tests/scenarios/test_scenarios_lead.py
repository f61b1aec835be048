"""The hot-learning-rate scenario, read for what came first: the spike's verdict names a
named block (not "other"), and the diagnosis is the learning rate.

Measured (seed 0): hot_lr in blocks.0/blocks.1/lm_head at step 110, loss_spike from step 121 in
tok_emb (the named block whose grad norm rose most); before the fix it named "other" (the final
LayerNorm) and the fix text opened with the init scale.
"""

from __future__ import annotations

from test_scenarios_training import RAMP, RAMP_FROM, default_config, train_gpt  # noqa: F401

from torchvitals.agent.tools.diagnose import diagnose


def test_hot_lr_spike_names_the_leading_block_and_the_learning_rate():
    def ramp(step, optimizer):
        if step > RAMP_FROM:
            for group in optimizer.param_groups:
                group["lr"] *= RAMP

    history, reports = train_gpt(0, 130, before_step=ramp)
    spikes = [v for v in history if v.pattern == "loss_spike"]
    assert spikes, [str(v) for v in history]
    assert all(v.block != "other" for v in spikes), [str(v) for v in spikes]
    assert spikes[0].block.startswith("blocks.") or spikes[0].block in (
        "tok_emb",
        "pos_emb",
        "lm_head",
    )
    d = diagnose(history, [(r.step, r.loss) for r in reports])
    assert d.cause == "gradient explosion" and d.summary.startswith("The learning rate is too high")
    assert d.fix.startswith("Lower the learning rate"), d.render()
