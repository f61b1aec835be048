"""A healthy run of the HF Trainer's GPT-2 raises no verdict at all, at a depth where the
vanishing-gradients rule has layers to compare (6 blocks ``transformer.h.*``, GPT-2's own 0.1
dropout; the 2-layer example's 200 steps are in test_frameworks.py, with Lightning's).

Measured before this test was written (one process, CPU): seeds 0-4 of the 2-layer example for
800 steps, seeds 0-1 of 6 and 12 layers for 300 steps: zero verdicts, loss 1.1 to 0.46.
"""

from __future__ import annotations

import os

import pytest
from transformers import Trainer, TrainerCallback  # missing: fails here, never skips

import torchvitals
from torchvitals.agent.tools.examples.hf_gpt2 import Arithmetic, arguments, tiny_gpt2

pytestmark = pytest.mark.frameworks


@pytest.fixture(autouse=True)
def default_config(monkeypatch):
    for key in list(os.environ):
        if key.startswith("TORCHVITALS_"):
            monkeypatch.delenv(key)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_hf_trainer_gpt2_raises_no_verdict(tmp_path, seed):
    hf = torchvitals.TransformersCallback(log_dir="", metrics_port=0)
    seen = []

    class Blocks(TrainerCallback):  # the blocks the agent judged, while it is alive
        def on_step_end(self, args, state, control, **kwargs):
            if not seen and hf.agent is not None:
                seen.extend(hf.agent.block_names)

    Trainer(
        model=tiny_gpt2(seed, layers=6, dropout=0.1),
        args=arguments(str(tmp_path), 80, seed=seed, logging_steps=1000),
        train_dataset=Arithmetic(2000, seed=seed),
        callbacks=[hf, Blocks()],
    ).train()
    assert [n for n in seen if n.startswith("transformer.h.")] == [
        f"transformer.h.{i}" for i in range(6)
    ]
    assert hf.last_report.step == 80 and hf.last_report.action == "step"
    assert not hf.verdicts, [str(v) for v in hf.verdicts]
    assert hf.last_report.loss < 3.0
