"""examples/hf_trainer.py's model and arguments (torchvitals.agent.tools.examples.hf_gpt2) under
torchrun, with a NaN loss on one rank at one batch, for tests/integration/test_frameworks.py.

    torchrun --standalone --nproc-per-node 2 tests/integration/hf_job.py OUT --fault-step 25
    torchrun ... hf_job.py OUT --fault-step 12 --steps 30 --framework-skip   # the optimizer skips

``--framework-skip`` puts the Trainer's optimizer inside ``SkipsNonFinite``, which skips the
step itself on non-finite gradients, and logs every step (the Trainer's own pre-clip gradient
norm). Each rank writes ``OUT/rank<r>.json``, as lightning_job.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import Trainer, TrainerCallback

import torchvitals
from torchvitals.agent.tools.examples.hf_gpt2 import Arithmetic, arguments, tiny_gpt2

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # real_steps
from real_steps import describe, nan_at, record_real_steps  # noqa: E402

CLIP = 0.1


class SkipsNonFinite:
    """An optimizer wrapper that skips the step itself when a gradient is not finite, the shape
    of DeepSpeed's fp16 optimizer and apex's amp: the inner optimizer's ``step`` is never called
    for that step, so torchvitals sees it only when the Trainer clears the gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.skipped: list[int] = []

    def step(self, closure=None):
        grads = [
            p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        if all(bool(torch.isfinite(g).all()) for g in grads):
            return self.optimizer.step(closure)
        self.skipped.append(len(self.skipped))
        return None

    def __getattr__(self, name):
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)


class SkippingTrainer(Trainer):
    """The Trainer with its optimizer inside ``SkipsNonFinite`` (accelerate's ``prepare`` passes
    what is not a torch optimizer through as it is; the scheduler drives the inner one)."""

    def create_optimizer(self, model=None):
        self.optimizer = SkipsNonFinite(super().create_optimizer(model))
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        return super().create_scheduler(num_training_steps, optimizer=self.optimizer.optimizer)


class Record(TrainerCallback):
    """What actually happened, read from the optimizer and the Trainer, not from torchvitals."""

    def __init__(self, vitals, model, rank: int, fault_step: int) -> None:
        self.vitals, self.model, self.rank, self.fault_step = vitals, model, rank, fault_step
        self.real, self.reports, self.micro_losses, self.lambdas = [], [], [], []

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        record_real_steps(getattr(optimizer, "optimizer", optimizer), self.real)
        self.lambdas = [lr_scheduler.lr_lambdas[0](s) for s in range(args.max_steps + 1)]
        self.base_lr = args.learning_rate

        nan_at(self.model, state, self.rank, self.fault_step, self.micro_losses)

    def on_step_end(self, args, state, control, **kwargs):
        self.reports.append(describe(self.vitals.agent.last_report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--framework-skip", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    vitals = torchvitals.TransformersCallback(
        checkpoint_dir=os.path.join(args.out, "ckpt"),
        checkpoint_every=10,
        log_dir="",
        metrics_port=0,
    )
    model = tiny_gpt2()
    record = Record(vitals, model, rank, args.fault_step)
    trainer_class = SkippingTrainer if args.framework_skip else Trainer
    trainer = trainer_class(
        model=model,
        args=arguments(
            os.path.join(args.out, "hf"),
            args.steps,
            max_grad_norm=CLIP,
            logging_steps=1 if args.framework_skip else 1000,
        ),
        train_dataset=Arithmetic(2000),
        callbacks=[vitals, record],
    )
    trainer.train()
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "micro_losses": record.micro_losses,
                "real": record.real,
                "reports": record.reports,
                "global_step": trainer.state.global_step,
                "accumulate": 2,
                "clip": CLIP,
                "base_lr": record.base_lr,
                "lr_lambda": record.lambdas,
                "trainer_grad_norm": logged,
                "skipped_by_optimizer": len(getattr(trainer.optimizer, "skipped", [])),
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
