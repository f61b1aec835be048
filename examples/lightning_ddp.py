"""Lightning with DDP, torchvitals watching every rank: one callback is the only change.

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --out runs/lightning
    python examples/lightning_ddp.py --devices 1 --out runs/lightning

Lightning keeps everything it owns: the loop, the scheduler (stepped every optimizer step), the
gradient clipping (``gradient_clip_val``), the gradient accumulation and its checkpoints.
torchvitals measures each step before Lightning clips, agrees on it with every rank, and steps,
skips or rolls back every rank together. The module, its data and the Trainer's settings ship
with the package (``torchvitals/agent/tools/examples/lightning_gpt.py``), so the tests train the
same ones.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl

import torchvitals
from torchvitals.agent.tools.examples.lightning_gpt import GPTModule, loader, trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="torchvitals_runs/lightning")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    args = parser.parse_args()
    pl.seed_everything(0, workers=True)
    vitals = torchvitals.LightningCallback(
        checkpoint_dir=os.path.join(args.out, "ckpt"),
        log_dir=args.out,
        run_name="events",
        metrics_port=0,
    )
    trainer(args.out, args.steps, args.devices, [vitals]).fit(
        GPTModule(total_steps=args.steps), loader(4000)
    )
    report = vitals.last_report
    if trainer_rank() == 0 and report is not None:
        print(
            f"step {report.step}: loss {report.loss:.3f}, lr {report.lr[0]:.2e}, "
            f"grad norm (before clipping) {report.grad_norm_total:.3f}"
        )


def trainer_rank() -> int:
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    main()
