"""fp16 autocast with a GradScaler: the agent unscales, measures true-scale norms, steps the scaler.

    python examples/fp16.py --steps 50

On a GPU it uses CUDA autocast; on CPU, torch's CPU float16 autocast and CPU GradScaler.
"""

import argparse

import torch

import torchvitals
from torchvitals.agent.tools.demo.data import random_batches
from torchvitals.agent.tools.demo.model import TinyGPT

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
model = TinyGPT(vocab=64, d_model=64, n_layers=2, seq_len=32).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
agent = torchvitals.watch(model, optimizer)
for inputs, targets in random_batches(args.steps, batch=8, seq_len=32, vocab=64):
    with torch.autocast(device, dtype=torch.float16):
        loss = model.loss(inputs.to(device), targets.to(device))
    scaler.scale(loss).backward()
    report = agent.step(loss, scaler=scaler)  # no scaler.step()/update() of yours
    optimizer.zero_grad(set_to_none=True)
print(
    f"step {report.step} loss {report.loss:.4f} grad_norm {report.grad_norm_total:.4f} "
    f"loss_scale {report.loss_scale:g} overflow {report.overflow}"
)
agent.close()
