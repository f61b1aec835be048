"""Attention statistics on sampled steps: the lowest per-head entropy and the largest logit.

Built in for ``nn.MultiheadAttention`` (from the attention weights it returns when called with
``need_weights=True``, its default; per head with ``average_attn_weights=False``). A custom
attention module calls one line in its forward, which costs nothing on unsampled steps::

    torchvitals.record_attention(self, logits=scores)       # or probs=attn_weights
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

F64 = torch.float64
_ARMED: list[AttentionStats] = []


def record_attention(
    module: nn.Module, *, probs: torch.Tensor | None = None, logits: torch.Tensor | None = None
) -> None:
    """Record a custom attention's scores; a no-op unless a watching agent samples this step.

    Args:
        module: the attention module (its block is found from its place in the model).
        probs: attention probabilities ``[..., heads, queries, keys]`` (rows sum to 1).
        logits: pre-softmax scores of the same shape (masked entries may be -inf).
    """
    for stats in _ARMED:
        stats.record(module, probs=probs, logits=logits)


def _per_head_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of the rows of each head: [..., heads, q, k] -> [heads]."""
    p = probs.detach().float()
    rows = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # [..., heads, q]
    if rows.dim() >= 2:
        return rows.transpose(0, -2).reshape(rows.shape[-2], -1).mean(-1)
    return rows.reshape(1, -1).mean(-1)


class AttentionStats:
    """Per block: records count, max of -min-entropy (a MAX reduction gives the minimum), max
    logit."""

    def __init__(self, root: nn.Module, blocks: Any):
        self._block_of: dict[int, int] = {}
        self._mha: list[nn.Module] = []
        for path, module in root.named_modules():
            b = blocks.block_of(path)
            if b is not None:
                self._block_of[id(module)] = b
            if isinstance(module, nn.MultiheadAttention):
                self._mha.append(module)
        self._n = len(blocks)
        self._handles: list[Any] = []
        self._reset()

    def _reset(self) -> None:
        self._counts = [0] * self._n
        self._neg_entropy: list[list[torch.Tensor]] = [[] for _ in range(self._n)]
        self._logit: list[list[torch.Tensor]] = [[] for _ in range(self._n)]

    def arm(self) -> None:
        if self in _ARMED:
            return
        _ARMED.append(self)
        self._handles = [m.register_forward_hook(self._mha_hook) for m in self._mha]

    def _mha_hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is not None and module.training and torch.is_grad_enabled():
            # Averaged weights come as [batch, q, k]: one "head", the average of them.
            self.record(module, probs=weights if weights.dim() == 4 else weights.unsqueeze(-3))

    def record(
        self,
        module: nn.Module,
        *,
        probs: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        b = self._block_of.get(id(module))
        if b is None or (probs is None and logits is None):
            return
        with torch.no_grad():
            if logits is not None:
                finite = torch.where(torch.isneginf(logits), torch.zeros_like(logits), logits)
                self._logit[b].append(finite.detach().amax().to(F64))
            if probs is None:
                assert logits is not None  # returned above when neither was given
                probs = torch.softmax(logits.detach().float(), dim=-1)
            self._neg_entropy[b].append((-_per_head_entropy(probs).amin()).to(F64))
        self._counts[b] += 1

    def take(self, device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Disarm; return (counts, per-block -min entropy, per-block max logit), -inf if absent."""
        if self in _ARMED:
            _ARMED.remove(self)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        none = torch.full((), -float("inf"), dtype=F64, device=device)
        neg = torch.stack(
            [torch.stack(v).amax().to(device) if v else none for v in self._neg_entropy]
        )
        logit = torch.stack([torch.stack(v).amax().to(device) if v else none for v in self._logit])
        counts = self._counts
        self._reset()
        return counts, neg, logit

    @property
    def armed(self) -> bool:
        return self in _ARMED

    def close(self) -> None:
        if self in _ARMED:
            _ARMED.remove(self)
        for handle in self._handles:
            handle.remove()
        self._handles = []
