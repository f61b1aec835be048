"""The smallest loop with torchvitals in place: one process, CPU or one GPU.

python examples/plain.py --steps 50
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
agent = torchvitals.watch(model, optimizer)  # 1. watch
for inputs, targets in random_batches(args.steps, batch=8, seq_len=32, vocab=64):
    loss = model.loss(inputs.to(device), targets.to(device))
    loss.backward()
    report = agent.step(loss)  # 2. instead of optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"step {report.step} loss {report.loss:.4f} grad_norm {report.grad_norm_total:.4f}")
print(agent.diagnose().render())
agent.close()
