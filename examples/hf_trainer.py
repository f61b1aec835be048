"""The Hugging Face Trainer, torchvitals watching every rank: one callback is the only change.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --out runs/hf
    python examples/hf_trainer.py --out runs/hf

A tiny GPT-2 built from its config (nothing is downloaded) learns a synthetic token stream. The
Trainer keeps everything it owns: its loop, its scheduler, ``max_grad_norm`` clipping, gradient
accumulation and logging. torchvitals takes the loss from the model's output, measures the
gradients before the Trainer clips them, agrees on each step with every rank, and steps, skips
or rolls back every rank together.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import torchvitals

SEQ, VOCAB = 32, 64


class Arithmetic(Dataset):
    """Token runs with a fixed stride and some noise: structure a small model learns."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ)) % VOCAB
        noise = torch.rand(seq.shape, generator=g) < 0.05
        self.seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)

    def __len__(self) -> int:
        return len(self.seq)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.seq[i], "labels": self.seq[i]}


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=64,
            n_layer=2,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def arguments(out: str, steps: int, seed: int = 0, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=10,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        weight_decay=0.01,
        logging_steps=25,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0,
        seed=seed,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


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
