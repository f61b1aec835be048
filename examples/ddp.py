"""DDP with torchvitals: every rank measures its share of the blocks, one reduction per step.

    torchrun --nproc-per-node 2 examples/ddp.py --steps 50

gloo on CPU, NCCL on GPUs. Rank r serves /metrics on 19400 + LOCAL_RANK.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torchvitals
from torchvitals.agent.tools.demo.data import random_batches
from torchvitals.agent.tools.demo.model import TinyGPT

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(0)  # the same initial weights
model = DistributedDataParallel(TinyGPT(vocab=64, d_model=64, n_layers=2, seq_len=32).to(device))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
agent = torchvitals.watch(model, optimizer)
for inputs, targets in random_batches(args.steps, batch=8, seq_len=32, vocab=64, seed=rank):
    logits = model(inputs.to(device))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten())
    loss.backward()
    report = agent.step(loss)  # identical on every rank
    optimizer.zero_grad(set_to_none=True)
if rank == 0:
    print(
        f"step {report.step} loss {report.loss:.4f} grad_norm {report.grad_norm_total:.4f} "
        f"blocks {len(report.grad_norm)}"
    )
agent.close()
dist.destroy_process_group()
