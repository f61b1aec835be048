"""A step's loss, wherever it comes from, packed for the reduction without a host sync.

    agent.record_loss(loss)            # once per micro-batch: the step's loss is their mean
    optimizer.step(closure)            # or the closure's return value
    outputs = hf_model(**batch)        # or the ``loss`` a model's output carries

Sources, first match wins: the loss given to ``agent.step(loss)``; the recorded losses (the
mean of ``record_loss`` calls and of the losses training forwards returned in their output);
the closure's return value. A micro-batch loss that was normalised by the number of items of
the whole accumulated step (Hugging Face's ``num_items_in_batch``) is a *share* of the step's
mean and is summed instead. With no loss known the step still measures gradients: the report's
loss is NaN, which no rule takes for a non-finite loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .stats import local

F64 = torch.float64


class LossBook:
    """The loss values recorded during one step, on the device."""

    def __init__(self) -> None:
        self._means: list[torch.Tensor | float] = []
        self._shares: list[torch.Tensor | float] = []
        self.capture = True
        """Record the ``loss`` of training forwards' outputs (off where a framework reports the
        loss itself)."""
        self.share_scale = 1.0
        """Multiplies recorded shares: a framework that normalises by the items of every rank
        (and multiplies by the world size before backward) sets the world size here."""

    def record(self, loss: torch.Tensor | float, *, share: bool = False) -> None:
        """Add one micro-batch's loss (detached; a tensor stays on its device)."""
        value = local(loss.detach()).reshape(()) if isinstance(loss, torch.Tensor) else float(loss)
        (self._shares if share else self._means).append(value)

    @property
    def pending(self) -> bool:
        """Losses were recorded since the last step took them."""
        return bool(self._means or self._shares)

    def capture_output(
        self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any
    ) -> None:
        """Forward hook: record the ``loss`` of a training forward's output (HF models)."""
        if not (self.capture and module.training and torch.is_grad_enabled()):
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            share = kwargs.get("num_items_in_batch") is not None
            self.record(loss * self.share_scale if share else loss, share=share)

    def take(self, given: Any, closure_loss: Any) -> torch.Tensor | float | None:
        """This step's loss on this rank, and forget the recorded ones.

        Args:
            given: the loss passed to ``agent.step`` (wins), or None.
            closure_loss: what the optimizer's closure returned, or None.
        """
        means, shares, self._means, self._shares = self._means, self._shares, [], []
        if given is not None:
            return given
        if shares:
            return _combine(shares, mean=False)
        if means:
            return _combine(means, mean=True)
        return closure_loss if isinstance(closure_loss, (torch.Tensor, float, int)) else None


def _combine(values: list[torch.Tensor | float], mean: bool) -> torch.Tensor | float:
    if len(values) == 1:  # one micro-batch: nothing to combine, no kernel to launch
        return values[0]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        total = sum(float(v) for v in values)
        return total / len(values) if mean else total
    device = tensors[0].device
    stacked = torch.stack(
        [
            v.to(device, F64)
            if isinstance(v, torch.Tensor)
            else torch.tensor(float(v), dtype=F64, device=device)
            for v in values
        ]
    )
    return stacked.mean() if mean else stacked.sum()
