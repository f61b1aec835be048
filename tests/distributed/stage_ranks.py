"""A two-stage pipeline by hand (torch.distributed send/recv, gloo), each rank watching its own
stage, for tests/distributed/test_pipeline_stages.py."""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

import torchvitals

STEPS, BATCH, WIDTH = 6, 8, 16


def stage(rank: int) -> nn.Module:
    """Rank 0: the embedding and layers 0-1; rank 1: layers 2-3 and the head (one model's
    parameter names, split)."""
    torch.manual_seed(0)
    emb, layers, head = (
        nn.Embedding(32, WIDTH),
        nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(4)}),
        nn.Linear(WIDTH, 32),
    )
    if rank == 0:
        return nn.Sequential(
            OrderedDict(emb=emb, layers=nn.ModuleDict({k: layers[k] for k in ("0", "1")}))
        )
    return nn.Sequential(
        OrderedDict(layers=nn.ModuleDict({k: layers[k] for k in ("2", "3")}), head=head)
    )


class Stage(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        inner = stage(rank)
        for name, child in inner.named_children():
            self.add_module(name, child)
        self.rank = rank

    def forward(self, x):
        if self.rank == 0:
            h = self.emb(x)
            for layer in self.layers.values():
                h = torch.tanh(layer(h))
            return h
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.head(x)


def two_stages(rank: int, world: int, fault_step: int) -> dict:
    model = Stage(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = torchvitals.watch(model, opt, log_dir="", metrics_port=0)
    gen = torch.Generator().manual_seed(7)
    out, norms = [], []
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, 32, (BATCH,), generator=gen)
        if rank == 0:
            h = model(tokens)
            dist.send(h.detach(), 1)
            grad = torch.empty_like(h)
            dist.recv(grad, 1)
            h.backward(grad)
        else:
            h = torch.empty(BATCH, WIDTH)
            dist.recv(h, 0)
            h.requires_grad_(True)
            loss = nn.functional.cross_entropy(model(h), tokens)
            if step == fault_step:
                loss = loss * float("nan")
            agent.record_loss(loss.detach())  # the loss exists on the last stage only
            loss.backward()
            dist.send(h.grad, 0)
        norms.append(
            {
                n: math.sqrt(
                    sum(float(p.grad.double().pow(2).sum()) for _, p in ps if p.grad is not None)
                )
                for n, ps in zip(agent.block_names, agent._blocks.params)
                if ps
            }
        )
        report = agent.step()
        opt.zero_grad(set_to_none=True)
        out.append(
            {
                "step": report.step,
                "action": report.action,
                "loss": report.loss,
                "grad_norm": report.grad_norm,
                "verdicts": [v.pattern for v in report.verdicts],
                "local_loss": loss.item() if rank == 1 else None,
            }
        )
    result = {
        "blocks": agent.block_names,
        "kinds": agent._blocks.kinds,
        "reports": out,
        "norms": norms,
    }
    agent.close()
    return result
