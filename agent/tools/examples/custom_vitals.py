"""A vital sign of your own, a rule that judges it and a TensorBoard sink, on the public seams.

    python examples/custom_vitals.py --log-dir runs/custom_vitals  # then: tensorboard --logdir runs
    agent = torchvitals.watch(
        model, optimizer,
        signals=[ParamNorm(model)],
        rules=[ParamNormGrowth(window=20, growth=1.2)],
        sinks=[TensorBoardSink("runs/custom_vitals")],
    )

Everything here is what a user would write in their own file: it imports ``torchvitals`` and
uses only the names the package exports (``torchvitals.Signal``, ``Rule``, ``Sink``,
``Verdict``, ``WARNING``), never a module inside it (``tests/unit/test_custom_vitals.py`` holds
that). It ships with the package only so the example and its tests run one source.

- ``ParamNorm``: the global L2 norm of the model's parameters, ``report.custom["param_norm"]``.
  Weights that keep growing (a learning rate too hot for the weight decay, a loss that rewards
  scale) show here many steps before the loss or the gradients blow up.
- ``ParamNormGrowth``: a warning when that norm grew by more than ``growth`` times (1.2) over
  the last ``window`` steps (20).
- ``TensorBoardSink``: the loss, the total and per-block gradient norms, the update ratios, the
  learning rates and every custom signal as TensorBoard scalars, the verdicts as text.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import torchvitals

PARAM_NORM = "param_norm"
"""The ``report.custom`` key ``ParamNorm`` fills."""
PARAM_NORM_GROWTH = "param_norm_growth"
"""The pattern ``ParamNormGrowth`` names."""


class ParamNorm(torchvitals.Signal):
    """The global L2 norm of the model's parameters, every step.

    Each rank adds the sum of squares of the parameter values it holds (a DTensor's local
    shard) to the step's one SUM vector: one float more in the collective the agent runs
    anyway, computed on the device with no host sync. The cost is one read of the weights.

    Args:
        model: the model whose parameters are measured (every rank passes its own).
        replicated: every rank holds the whole model (one process, DDP): the ranks' sum is
            divided by the world size. False: each rank holds its own part (FSDP2 shards,
            pipeline stages): the ranks' sum is the whole.
    """

    rules = ("ParamNormGrowth",)
    fills = (f"custom.{PARAM_NORM}",)

    def __init__(self, model: nn.Module, *, replicated: bool = True) -> None:
        self.params = [p for p in model.parameters()]
        self.replicated = replicated

    def pack(self, ctx: torchvitals.StepContext, packer: torchvitals.Packer) -> torchvitals.Slot:
        # Same slot on every rank every step: the SUM is added slot by slot.
        norms = torch.stack(
            [
                torch.linalg.vector_norm(_local(p.detach()), dtype=torch.float64).to(ctx.device)
                for p in self.params
            ]
        )
        return packer.add_sum((norms * norms).sum())

    def unpack(
        self,
        ctx: torchvitals.StepContext,
        handle: torchvitals.Slot,
        reduced: torchvitals.Reduced,
        report: torchvitals.Report,
        seen: torchvitals.Observed,
    ) -> None:
        total = reduced.scalar(handle)
        if self.replicated:
            total /= ctx.world_size
        report.custom[PARAM_NORM] = math.sqrt(total) if total >= 0 else math.nan


class ParamNormGrowth(torchvitals.Rule):
    """A warning while the parameter norm is more than ``growth`` times what it was ``window``
    steps ago. Healthy training moves the norm slowly (the demo GPT: 0.2% in 20 steps at AdamW's
    1e-3, 90% with the learning rate 100 times that); 20% within 20 steps is the weights running
    away.

    Args:
        window: how many steps back the norm is compared with.
        growth: the ratio over the window above which the rule fires.
    """

    patterns = (PARAM_NORM_GROWTH,)

    def __init__(self, window: int = 20, growth: float = 1.2) -> None:
        if window < 1 or growth <= 1:
            raise ValueError("ParamNormGrowth needs window >= 1 and growth > 1")
        self.window, self.growth = window, growth
        self.norms: deque[float] = deque(maxlen=window + 1)

    def observe(
        self, report: torchvitals.Report, seen: torchvitals.Observed
    ) -> list[torchvitals.Verdict] | None:
        norm = report.custom.get(PARAM_NORM)
        if norm is None or not math.isfinite(norm):
            return None  # not measured (or NaN: the non-finite rules speak for that step)
        self.norms.append(norm)
        if len(self.norms) <= self.window or self.norms[0] <= 0:
            return []
        ratio = norm / self.norms[0]
        if ratio <= self.growth:
            return []
        evidence = {PARAM_NORM: norm, "ratio": ratio, "window": self.window, "growth": self.growth}
        return [
            torchvitals.Verdict(PARAM_NORM_GROWTH, torchvitals.WARNING, report.step, None, evidence)
        ]


class TensorBoardSink(torchvitals.Sink):
    """Every step's vital signs as TensorBoard scalars, written by global rank 0.

    Scalars: ``loss``, ``grad_norm_total``, ``grad_norm/<block>``, ``update_ratio/<block>`` (at
    the step whose update they describe), ``lr/<param group>``, ``custom/<name>`` for each of
    your signals; each verdict as text under ``verdicts``. After a rollback the steps it undid
    are written again (TensorBoard shows both).

    Args:
        log_dir: the folder of the event files (``tensorboard --logdir`` it).
        every: write every ``every``-th step (steps with a verdict always).
    """

    name = "TensorBoard sink"

    def __init__(self, log_dir: str, *, every: int = 1) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._writer_class = SummaryWriter
        self.log_dir, self.every = log_dir, every
        self.writer: Any = None
        """The ``SummaryWriter``, opened at rank 0's first step (None on the other ranks)."""

    def publish(self, report: torchvitals.Report) -> None:
        if report.rank != 0 or (report.step % self.every and not report.verdicts):
            return
        if self.writer is None:
            self.writer = self._writer_class(log_dir=self.log_dir)
        w, step = self.writer, report.step
        w.add_scalar("loss", report.loss, step)
        w.add_scalar("grad_norm_total", report.grad_norm_total, step)
        for block, norm in report.grad_norm.items():
            w.add_scalar(f"grad_norm/{block}", norm, step)
        for block, ratio in report.update_ratio.items():
            w.add_scalar(f"update_ratio/{block}", ratio, report.update_ratio_step or step)
        for group, lr in enumerate(report.lr):
            w.add_scalar(f"lr/{group}", lr, step)
        for name, value in report.custom.items():
            w.add_scalar(f"custom/{name}", value, step)
        for verdict in report.verdicts:
            w.add_text("verdicts", str(verdict), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t
