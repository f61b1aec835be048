"""The training loops benchmarks/overhead.py times against each other; each does one whole step.

    python benchmarks/overhead.py --variants bare,default,naive

Every variant owns a fresh TinyGPT and AdamW built from the same seed, so the variants differ
only in what watches them. ``step(x, y)`` runs forward, backward, the optimizer step and
``zero_grad``; the variant's monitoring adds whatever it adds around those.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchvitals
from torchvitals.agent.tools.demo.model import TinyGPT

SEED = 0


class Bare:
    """The loop with nothing watching: forward, backward, optimizer.step, zero_grad."""

    def __init__(self, model_kwargs: dict[str, int], ddp: bool):
        torch.manual_seed(SEED)
        self.model = TinyGPT(**model_kwargs)
        # DDP broadcasts rank 0's weights; the seed already makes them equal everywhere.
        self.net: nn.Module = DistributedDataParallel(self.model) if ddp else self.model
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=3e-4, foreach=True)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Through the (possibly DDP) wrapper's forward: TinyGPT.loss would bypass DDP's hooks.
        logits = self.net(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.loss(x, y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class Agent(Bare):
    """torchvitals.watch around the (DDP) model; ``agent.step`` calls ``optimizer.step``."""

    def __init__(self, model_kwargs: dict[str, int], ddp: bool, **config: Any):
        super().__init__(model_kwargs, ddp)
        self.agent = torchvitals.watch(self.net, self.opt, **config)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = self.loss(x, y)
        loss.backward()
        self.agent.step(loss)
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        self.agent.close()


class Guarded(Agent):
    """The loop keeps calling ``optimizer.step()`` (a framework's or nanoGPT's way): the guard
    runs the agent; the loss arrives through ``record_loss``."""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = self.loss(x, y)
        self.agent.record_loss(loss)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Watchdog(Agent):
    """The agent with the watchdog on: a healthy checkpoint every 50 steps into ``root``, staged
    and written in the background (``staged=True``) or synchronously. Records each save's stall
    (what ``agent.step`` spent saving) and, at close, one rollback from memory and one from disk."""

    def __init__(self, model_kwargs: dict[str, int], ddp: bool, root: str, staged: bool):
        shutil.rmtree(root, ignore_errors=True)
        super().__init__(
            model_kwargs,
            ddp,
            metrics_port=0,
            log_dir="",
            checkpoint_dir=root,
            checkpoint_every=50,
            **({} if staged else {"snapshot_max_bytes": 0}),
        )
        if self.agent.watchdog is None:
            raise RuntimeError("checkpoint_dir is set, yet the agent runs no watchdog")
        self.watchdog = self.agent.watchdog
        self.stalls: list[float] = []
        self.restore_s: dict[str, float] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = self.loss(x, y)
        loss.backward()
        report = self.agent.step(loss)
        self.opt.zero_grad(set_to_none=True)
        if report.checkpoint.saved:
            self.stalls.append(self.watchdog.metrics()["checkpoint_stall_seconds"])

    def close(self) -> None:
        watchdog = self.watchdog
        self.agent.close()  # settles a write in flight: the memory copy is committed
        staged = watchdog.staged
        if watchdog.last_healthy is None:
            return
        if staged is not None and staged.memory is not None:
            start = time.perf_counter()
            staged.restore(watchdog.last_healthy, self.net, self.opt, None)
            self.restore_s["memory"] = time.perf_counter() - start
        start = time.perf_counter()
        watchdog.store.load(self.net, self.opt, None)
        self.restore_s["disk"] = time.perf_counter() - start


class Naive(Bare):
    """What people write by hand, every step and on every rank: one ``.item()`` per number.

    Per-parameter gradient norms summed into per-block norms; mean/std/abs-max/zero-fraction
    of each block's output from forward hooks; the update ratio from a per-parameter clone
    before the step. The blocks are the ones the agent measures (embeddings, layers, head).
    """

    def __init__(self, model_kwargs: dict[str, int], ddp: bool):
        super().__init__(model_kwargs, ddp)
        m = self.model
        self.params = [
            (
                name.split(".")[0]
                if not name.startswith("blocks.")
                else ".".join(name.split(".")[:2]),
                p,
            )
            for name, p in m.named_parameters()
        ]
        watched = {"tok_emb": m.tok_emb, "pos_emb": m.pos_emb, "lm_head": m.lm_head}
        watched.update({f"blocks.{i}": b for i, b in enumerate(m.blocks)})
        self.handles = [
            mod.register_forward_hook(self._hook(name)) for name, mod in watched.items()
        ]
        self.activations: dict[str, dict[str, float]] = {}
        self.grad_norm: dict[str, float] = {}
        self.update_ratio: dict[str, float] = {}

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            if not module.training:
                return
            x = output.detach()
            self.activations[name] = {
                "mean": x.mean().item(),
                "std": x.std().item(),
                "abs_max": x.abs().max().item(),
                "zero_fraction": (x == 0).float().mean().item(),
            }

        return hook

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.loss(x, y).backward()
        sq: dict[str, float] = {}
        for block, p in self.params:
            if p.grad is not None:
                sq[block] = sq.get(block, 0.0) + p.grad.norm().item() ** 2
        self.grad_norm = {b: math.sqrt(v) for b, v in sq.items()}
        before = [p.detach().clone() for _, p in self.params]
        self.opt.step()
        d_sq: dict[str, float] = {}
        w_sq: dict[str, float] = {}
        for (block, p), old in zip(self.params, before):
            d_sq[block] = d_sq.get(block, 0.0) + (p.detach() - old).norm().item() ** 2
            w_sq[block] = w_sq.get(block, 0.0) + old.norm().item() ** 2
        self.update_ratio = {b: math.sqrt(d_sq[b] / w_sq[b]) for b in d_sq}
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class Wandb(Bare):
    """``wandb.watch(model, log="all", log_freq=1)`` in an offline run, one run per rank."""

    def __init__(self, model_kwargs: dict[str, int], ddp: bool, tmp: str, rank: int):
        import wandb  # the caller checked it imports

        super().__init__(model_kwargs, ddp)
        self.wandb = wandb
        self.run = wandb.init(
            mode="offline",
            dir=tmp,
            project="torchvitals-overhead",
            name=f"rank{rank}",
            settings=wandb.Settings(silent=True),
        )
        wandb.watch(self.net, log="all", log_freq=1)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = self.loss(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        # wandb.watch's hooks stage their histograms uncommitted; a log call commits the step.
        self.run.log({"loss": loss.item()})

    def close(self) -> None:
        self.run.finish()
        teardown = getattr(self.wandb, "teardown", None)
        if teardown is not None:
            teardown()  # stop the background service so it cannot disturb later measurements


ABUSE = """
import socket, sys, time, urllib.request
port = int(sys.argv[1])
url = f"http://127.0.0.1:{port}/metrics"
idle = []
for _ in range(200):
    try:
        idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except OSError:
        pass
while True:
    try:
        urllib.request.urlopen(url, timeout=5).read()
    except OSError:
        time.sleep(0.01)
"""


class Abused(Agent):
    """``export`` whose /metrics is abused by another process for the whole run: 200 idle
    connections and a scrape loop as fast as it goes. The load runs while every variant is timed
    (its CPU hits them alike, interleaved); only this variant's exporter serves it, so the ratio
    to ``export`` is what the abuse costs the training process itself."""

    def __init__(self, model_kwargs: dict[str, int], ddp: bool, tmp: str, rank: int):
        from torchvitals.agent.tools.demo.launch import free_ports

        base = free_ports(2)
        super().__init__(model_kwargs, ddp, metrics_port=base, log_dir=os.path.join(tmp, "abused"))
        import subprocess

        self.load = subprocess.Popen([sys.executable, "-c", ABUSE, str(base + rank)])

    def close(self) -> None:
        self.load.kill()
        self.load.wait(10)
        super().close()


def wandb_missing() -> str | None:
    """Why the wandb variant cannot run here, or None when it can."""
    try:
        import wandb  # noqa: F401
    except Exception as exc:
        return f"wandb is not importable ({type(exc).__name__}: {exc}); pip install wandb"
    return None


VARIANTS = (
    "bare",
    "default",
    "guarded",
    "export",
    "abused",
    "every",
    "watchdog",
    "watchsync",
    "naive",
    "wandb",
)
DESCRIPTIONS = {
    "bare": "no monitoring",
    "default": "torchvitals, sample_every=10, exporter and event log off",
    "guarded": "default, the loop calling optimizer.step() (guarded) and record_loss",
    "export": "default + Prometheus exporter + event log",
    "abused": "export, /metrics under 200 idle connections and a tight scrape loop",
    "every": "torchvitals, every signal every step (sample_every=1)",
    "watchdog": "default + watchdog, checkpoint_every=50, staged + background write",
    "watchsync": "default + watchdog, checkpoint_every=50, synchronous save",
    "naive": "hand-written .item() per parameter/block, every step",
    "wandb": 'wandb.watch(log="all", log_freq=1), offline',
}


def build(
    name: str,
    model_kwargs: dict[str, int],
    *,
    ddp: bool,
    rank: int,
    tmp: str,
    port: int,
    shared: str = "",
) -> Bare:
    """One variant by name (see VARIANTS); ``port`` and ``tmp`` serve the exporter and logs,
    ``shared`` (a folder every rank sees) the checkpoints."""
    if name == "bare":
        return Bare(model_kwargs, ddp)
    if name == "default":
        return Agent(model_kwargs, ddp, metrics_port=0, log_dir="")
    if name == "guarded":
        return Guarded(model_kwargs, ddp, metrics_port=0, log_dir="")
    if name == "export":
        return Agent(model_kwargs, ddp, metrics_port=port, log_dir=os.path.join(tmp, "runs"))
    if name == "abused":
        return Abused(model_kwargs, ddp, tmp, rank)
    if name == "every":
        return Agent(model_kwargs, ddp, metrics_port=0, log_dir="", sample_every=1)
    if name in ("watchdog", "watchsync"):
        return Watchdog(model_kwargs, ddp, os.path.join(shared, name), staged=name == "watchdog")
    if name == "naive":
        return Naive(model_kwargs, ddp)
    if name == "wandb":
        return Wandb(model_kwargs, ddp, tmp, rank)
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
