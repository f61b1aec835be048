"""A small llama-shaped language model for tests: the layers live in an ``nn.ModuleDict`` keyed
"0", "1", ... (as torchtitan keeps them), with RMSNorm, SwiGLU and a fused QKV projection whose
state-dict hooks present it as the separate ``wq``/``wk``/``wv`` weights a checkpoint expects.
Unfused, it takes torchtitan's tensor-parallel plans (``support.meshes``): the attention reads its
heads and sequence length from the projections' outputs, not from its input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedQKV(nn.Module):
    """One ``wqkv`` weight, saved and loaded as ``wq``/``wk``/``wv`` (the way fused projections
    keep checkpoints compatible with the unfused model)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.register_state_dict_post_hook(FusedQKV._split)
        self.register_load_state_dict_pre_hook(FusedQKV._fuse)

    @staticmethod
    def _split(module, state, prefix, local_metadata):
        fused = state.pop(prefix + "wqkv.weight")
        for name, part in zip(("wq", "wk", "wv"), fused.chunk(3, dim=0)):
            state[prefix + name + ".weight"] = part

    @staticmethod
    def _fuse(module, state, prefix, *args):
        names = [prefix + n + ".weight" for n in ("wq", "wk", "wv")]
        if all(n in state for n in names):
            state[prefix + "wqkv.weight"] = torch.cat([state.pop(n) for n in names], dim=0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.wqkv(x).chunk(3, dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, fused: bool):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(dim)
        self.qkv = FusedQKV(dim) if fused else None
        if not fused:
            self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head_dim = self.wo.in_features // self.heads
        h = self.attention_norm(x)
        q, k, v = self.qkv(h) if self.qkv is not None else (self.wq(h), self.wk(h), self.wv(h))
        # Heads and sequence from the projections themselves: under tensor parallelism a rank
        # holds some of the heads, and under sequence parallelism the projections see the whole
        # sequence while ``x`` holds a piece of it.
        q, k, v = (z.unflatten(-1, (-1, head_dim)).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).flatten(2))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LlamaLike(nn.Module):
    """tok_embeddings -> layers (ModuleDict) -> norm -> output."""

    def __init__(
        self, vocab: int = 64, dim: int = 32, n_layers: int = 3, heads: int = 4, fused: bool = False
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, fused) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
