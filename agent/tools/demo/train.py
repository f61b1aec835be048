"""One rank of ``torchvitals demo``: a small GPT on the bundled text, DDP on gloo, under the agent.

    torchvitals demo --fault lr-spike       # the launcher (demo/launch.py) runs this on each rank

The loop is the README's watchdog loop, unchanged; the only demo-specific code is the fault,
injected from outside the agent at ``fault_step`` the way a real bug would arrive:

- ``lr-spike``: the learning rate ramps up 1.6x per step for 8 steps (x43 in all), as a schedule
  with a wrong warm-up would. The update ratio leaves the healthy 1e-3 band first (the ``hot_lr``
  warning), then the loss spikes (the critical ``loss_spike``) and the watchdog rolls back.
- ``nan``: the last rank's loss is NaN once (a bad batch on one host); every rank rolls back
  together.
- ``frozen``: block 1's learning rate drops to 0 (a parameter group mis-set): the update ratio
  pins at 0 and the ``dead_layer`` warning names the block. Not critical: nothing to roll back.
- ``none``: a healthy run, for comparison.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import torchvitals

from ....protocol import DEMO_FAULTS as FAULTS
from .data import Vocab, load_text, text_batches
from .model import TinyGPT

RAMP_STEPS, RAMP_FACTOR = 8, 1.6
FROZEN_BLOCK = "blocks.1"


@dataclass(kw_only=True)
class DemoRun:
    """What every rank trains and how (plain data: it crosses the process spawn)."""

    out: str
    """The run folder: events.jsonl, checkpoints/ (with ledger.json), summary.json, the report."""
    steps: int = 150
    """Optimizer steps to reach (a rollback sets the count back, so more batches are drawn)."""
    fault: str = "lr-spike"
    """One of FAULTS."""
    fault_step: int | None = None
    """The step the fault arrives after (default: 55% of ``steps``)."""
    metrics_port: int = 0
    """Base port of the ranks' /metrics (rank r serves base + r); 0 serves none."""
    live: bool = True
    """Rank 0 draws the live view."""
    lr: float = 2e-3
    batch: int = 16
    seq_len: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {self.fault!r}")
        if self.steps < 30:
            raise ValueError(
                f"steps must be >= 30 (the detector's warm-up and a checkpoint "
                f"come first), got {self.steps}"
            )
        if self.fault_step is None:
            self.fault_step = int(self.steps * 0.55)

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.out, "checkpoints")


WATCH: dict[str, Any] = dict(
    sample_every=5,
    checkpoint_every=10,
    healthy_window=5,
    checkpoint_keep=2,
    lr_backoff=0.5,
    skip_margin=2,
    detect={"straggler_min_seconds": 0.5},
)
"""Tighter than the defaults so a short run shows everything: a sample every 5 steps (the
update ratio's early warning needs samples), a healthy checkpoint every 10. The ranks share a
laptop's cores with everything else on it, so a rank counts as a straggler only when it is half a
second slower (the default 50 ms flags a busy laptop's scheduler, not a slow host)."""


def build(run: DemoRun, vocab: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same initial model on every rank under DDP; block 1 in its own parameter group so the
    ``frozen`` fault can zero its learning rate."""
    torch.manual_seed(run.seed)
    model = TinyGPT(vocab=vocab, d_model=64, n_layers=4, n_heads=4, seq_len=run.seq_len)
    ddp = DistributedDataParallel(model)
    frozen = [p for n, p in model.named_parameters() if n.startswith(FROZEN_BLOCK + ".")]
    rest = [p for n, p in model.named_parameters() if not n.startswith(FROZEN_BLOCK + ".")]
    optimizer = torch.optim.AdamW(
        [{"params": rest}, {"params": frozen}], lr=run.lr, weight_decay=0.01
    )
    return ddp, optimizer


def inject(
    run: DemoRun,
    step: int,
    rank: int,
    world: int,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    done: set[int | str],
) -> torch.Tensor:
    """Apply the fault due at ``step`` (each at most once: a rollback replays step numbers)."""
    start = run.fault_step
    if start is None:  # DemoRun sets it; a run that cleared it has no fault to inject
        return loss
    if run.fault == "lr-spike" and start < step <= start + RAMP_STEPS and step not in done:
        done.add(step)
        for group in optimizer.param_groups:
            group["lr"] *= RAMP_FACTOR
    elif run.fault == "nan" and step == start + 1 and rank == world - 1 and "nan" not in done:
        done.add("nan")
        loss = loss * float("nan")
    elif run.fault == "frozen" and step == start + 1 and "frozen" not in done:
        done.add("frozen")
        optimizer.param_groups[1]["lr"] = 0.0
    return loss


def train(rank: int, world: int, run: DemoRun) -> dict[str, Any]:
    """Train this rank to ``run.steps``; rank 0 writes ``summary.json``. Returns the summary."""
    text = load_text()
    vocab = Vocab(text)
    model, optimizer = build(run, len(vocab))
    batches = text_batches(text, vocab, run.steps, run.batch, run.seq_len, seed=1000 + rank)
    agent = torchvitals.watch(
        model,
        optimizer,
        checkpoint_dir=run.checkpoint_dir,
        metrics_port=run.metrics_port,
        log_dir=os.path.dirname(os.path.abspath(run.out)),
        run_name=os.path.basename(os.path.abspath(run.out)),
        live=run.live and rank == 0,
        **WATCH,
    )
    done: set[int | str] = set()
    report = None
    with agent:
        watchdog = agent.watchdog
        if watchdog is None:
            raise RuntimeError("the demo's agent has no watchdog, though it has a checkpoint_dir")
        while agent.step_count < run.steps:
            for inputs, targets in agent.batches(batches):
                loss = _loss(model, inputs, targets)
                loss = inject(run, agent.step_count + 1, rank, world, optimizer, loss, done)
                loss.backward()
                report = agent.step(loss, samples=inputs.shape[0])
                optimizer.zero_grad(set_to_none=True)
                if agent.step_count >= run.steps:
                    break
        summary = {
            "steps": agent.step_count,
            "final_loss": report.loss if report else math.nan,
            "lr_scale": agent.lr_scale,
            "skipped": [list(r) for r in agent.skipped_batches],
            "rollbacks": watchdog.rollbacks,
            "active_at_end": sorted({v.pattern for v in agent.detector.active.values()}),
            "world_size": world,
            "run": asdict(run),
        }
        # Healthy: the last steps trained without a verdict and none is still active (a frozen
        # block stays a dead layer: a rollback cannot fix it, so that run does not end healthy).
        summary["healthy_at_end"] = bool(
            report is not None
            and report.action == torchvitals.Action.STEP
            and watchdog.healthy(agent.step_count, agent.detector)
            and not summary["active_at_end"]
        )
    if rank == 0:
        path = os.path.join(run.out, "summary.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        os.replace(path + ".tmp", path)
    return summary


def _loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )
