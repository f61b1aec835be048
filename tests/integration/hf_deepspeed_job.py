r"""examples/hf_trainer.py's model under the Hugging Face Trainer with a ``deepspeed=`` config
(ZeRO stage from the command line) and ``TransformersCallback``, with a NaN loss on one rank at
one micro-batch, for tests/integration/test_deepspeed.py.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 \
        tests/integration/hf_deepspeed_job.py OUT --stage 2

Each rank writes ``OUT/rank<r>.json``: every report, the engine's own global norm at each step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from transformers import Trainer, TrainerCallback

import torchvitals
from torchvitals.agent.tools.examples.hf_gpt2 import Arithmetic, arguments, tiny_gpt2

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # real_steps
from real_steps import describe, nan_at  # noqa: E402

CLIP = 0.1


class Record(TrainerCallback):
    def __init__(self, vitals, model, rank: int, fault_step: int) -> None:
        self.vitals, self.model, self.rank, self.fault_step = vitals, model, rank, fault_step
        self.reports, self.engine_norms, self.trainer = [], [], None

    def on_train_begin(self, args, state, control, **kwargs):
        nan_at(self.model, state, self.rank, self.fault_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.reports.append(describe(self.vitals.agent.last_report))
        self.reports[-1]["grad_norm"] = self.vitals.agent.last_report.grad_norm
        norm = self.trainer.model_wrapped.get_global_grad_norm()
        self.engine_norms.append(None if norm is None else float(norm))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    watchdog = (
        dict(
            checkpoint_dir=os.path.join(args.out, "ckpt"),
            checkpoint_every=args.checkpoint_every,
            trust_steps=1,  # the scenarios' faults come two steps after the checkpoint they restore
        )
        if args.checkpoint_every
        else {}
    )
    vitals = torchvitals.TransformersCallback(log_dir="", metrics_port=0, **watchdog)
    model = tiny_gpt2()
    record = Record(vitals, model, rank, args.fault_step)
    ds = {
        "zero_optimization": {"stage": args.stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    trainer = Trainer(
        model=model,
        args=arguments(
            os.path.join(args.out, "hf"),
            args.steps,
            max_grad_norm=CLIP,
            logging_steps=1000,
            deepspeed=ds,
        ),
        train_dataset=Arithmetic(2000),
        callbacks=[vitals, record],
    )
    record.trainer = trainer
    trainer.train()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "reports": record.reports,
                "engine_norms": record.engine_norms,
                "global_step": trainer.state.global_step,
                "clip": CLIP,
            },
            f,
        )


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
