"""The Hugging Face Trainer, torchvitals watching every rank: one callback is the only change.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --out runs/hf
    python examples/hf_trainer.py --out runs/hf

A tiny GPT-2 built from its config (nothing is downloaded) learns a synthetic token stream. The
Trainer keeps everything it owns: its loop, its scheduler, ``max_grad_norm`` clipping, gradient
accumulation and logging. torchvitals takes the loss from the model's output, measures the
gradients before the Trainer clips them, agrees on each step with every rank, and steps, skips
or rolls back every rank together. The model, its data and the Trainer's arguments ship with
the package (``torchvitals/agent/tools/examples/hf_gpt2.py``), so the tests train the same ones.
"""

from __future__ import annotations

import argparse
import os

from transformers import Trainer

import torchvitals
from torchvitals.agent.tools.examples.hf_gpt2 import Arithmetic, arguments, tiny_gpt2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="torchvitals_runs/hf")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    vitals = torchvitals.TransformersCallback(
        checkpoint_dir=os.path.join(args.out, "ckpt"),
        log_dir=args.out,
        run_name="events",
        metrics_port=0,
    )
    trainer = Trainer(
        model=tiny_gpt2(),
        args=arguments(args.out, args.steps),
        train_dataset=Arithmetic(4000),
        callbacks=[vitals],
    )
    trainer.train()
    report = vitals.last_report
    if trainer.is_world_process_zero() and report is not None:
        print(
            f"step {report.step}: loss {report.loss:.3f}, lr {report.lr[0]:.2e}, "
            f"grad norm (before clipping) {report.grad_norm_total:.3f}"
        )


if __name__ == "__main__":
    main()
