"""FSDP2 (``fully_shard``) with torchvitals: each rank reduces its local shards, the norms exact.

torchrun --nproc-per-node 2 examples/fsdp2.py --steps 50
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

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
mesh = init_device_mesh(device.type, (dist.get_world_size(),))
torch.manual_seed(0)
model = TinyGPT(vocab=64, d_model=64, n_layers=2, seq_len=32).to(device)
for block in model.blocks:  # shard each block, then the root
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
agent = torchvitals.watch(model, optimizer)
for inputs, targets in random_batches(args.steps, batch=8, seq_len=32, vocab=64, seed=rank):
    loss = model.loss(inputs.to(device), targets.to(device))
    loss.backward()
    report = agent.step(loss)
    optimizer.zero_grad(set_to_none=True)
if rank == 0:
    print(
        f"step {report.step} loss {report.loss:.4f} grad_norm {report.grad_norm_total:.4f} "
        f"blocks {len(report.grad_norm)}"
    )
agent.close()
dist.destroy_process_group()
