"""The tiny GPT-2, its dataset and TrainingArguments: what examples/hf_trainer.py trains.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --out runs/hf
    from torchvitals.agent.tools.examples.hf_gpt2 import Arithmetic, arguments, tiny_gpt2
    Trainer(model=tiny_gpt2(), args=arguments(out, 200), train_dataset=Arithmetic(4000), ...)

GPT-2 built from its config (nothing is downloaded) learning a synthetic token stream; the
arguments clip at 1.0, accumulate two micro-batches and run a warmup + cosine schedule, on CPU
(gloo under torchrun). Needs transformers (``pip install "torchvitals[transformers]"``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

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


def tiny_gpt2(seed: int = 0, layers: int = 2, dropout: float = 0.0) -> GPT2LMHeadModel:
    """The example's GPT-2 (2 layers, no dropout), or a deeper one with GPT-2's own dropout."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=64,
            n_layer=layers,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
            n_head=4,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
    )


def arguments(out: str, steps: int, seed: int = 0, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(
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
