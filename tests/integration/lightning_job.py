"""examples/lightning_ddp.py's module and Trainer (torchvitals.agent.tools.examples.lightning_gpt)
under torchrun, with a NaN loss on one rank at one batch, for tests/integration/test_frameworks.py.

    torchrun --standalone --nproc-per-node 2 tests/integration/lightning_job.py OUT --fault-step 25

Each rank writes ``OUT/rank<r>.json``: its micro-batch losses, the real optimizer steps (the
optimizer's own step hooks, which fire only inside the real step), the learning rate and the
post-clip gradient norm each real step ran with, every report, and Lightning's global step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning.pytorch as pl

import torchvitals
from torchvitals.agent.tools.examples.lightning_gpt import GPTModule, loader

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # real_steps
from real_steps import describe, record_real_steps  # noqa: E402

CLIP = 0.1


class Faulty(GPTModule):
    """The example's module; rank 1's loss is NaN on the first micro-batch of ``fault_step``."""

    def __init__(self, fault_step: int, total_steps: int) -> None:
        super().__init__(total_steps=total_steps)
        self.fault_step, self.fired, self.micro_losses = fault_step, False, []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.micro_losses.append(loss.item())
        if self.global_rank == 1 and self.trainer.global_step == self.fault_step and not self.fired:
            self.fired = True
            loss = loss * float("nan")
        return loss


class Record(pl.Callback):
    """What actually happened, read from the optimizer and Lightning, not from torchvitals."""

    def __init__(self, vitals: torchvitals.LightningCallback) -> None:
        self.vitals, self.real, self.reports, self.last = vitals, [], [], None

    def on_fit_start(self, trainer, pl_module):
        record_real_steps(trainer.optimizers[0], self.real)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        report = self.vitals.agent.last_report if self.vitals.agent else None
        if report is not None and report is not self.last:  # an optimizer step happened
            self.last = report
            self.reports.append(describe(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    pl.seed_everything(0)
    vitals = torchvitals.LightningCallback(
        checkpoint_dir=os.path.join(args.out, "ckpt"),
        checkpoint_every=10,
        log_dir="",
        metrics_port=0,
    )
    record = Record(vitals)
    module = Faulty(args.fault_step, args.steps)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy="ddp",
        max_steps=args.steps,
        gradient_clip_val=CLIP,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[vitals, record],
    )
    trainer.fit(module, loader(2000))
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(
            {
                "micro_losses": module.micro_losses,
                "real": record.real,
                "reports": record.reports,
                "global_step": trainer.global_step,
                "accumulate": 2,
                "clip": CLIP,
                "base_lr": module.lr,
                "lr_lambda": [
                    module.configure_optimizers()["lr_scheduler"]["scheduler"].lr_lambdas[0](s)
                    for s in range(args.steps + 1)
                ],
            },
            f,
        )


if __name__ == "__main__":
    main()
    # The results are written: leave without the interpreter's teardown, where gloo's threads
    # can abort a rank whose peer already left (the test asserts the run, not the teardown).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
