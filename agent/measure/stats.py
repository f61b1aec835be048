"""Per-block statistics computed on the device, without host syncs: this rank's share only.

Every function here returns device tensors of per-block *sums* (sums of squares, counts) that a
SUM all-reduce turns into exact global values:

- gradients: under FSDP2 each rank holds a shard of each gradient, and the squared norms of the
  local shards add up to the squared norm of the whole (``to_local()`` excludes padding); under
  DDP the gradients are identical on every rank, so each rank takes a disjoint set of blocks
  (``owned``) and the SUM reassembles them instead of multiplying by the world size.
  A DTensor's local values have identical copies on every rank that holds the parameter but not
  another piece of it (HSDP's replicate dimension; under FSDP x TP, on the tp ranks of a
  parameter sharded over the dp mesh only): each copy is weighted by one over their number, once
  at ``watch()`` (``replicas``).
- update ratio: the same split, over parameters snapshotted around ``optimizer.step()``.
- activations: each rank sees its own data; sums, counts and (via MAX) abs_max combine.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement

from ..backends.base import GradSource, ParamSource
from ..compat.pytorch import foreach_mul, foreach_norm, foreach_sub_
from .blocks import Blocks

F64 = torch.float64


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a tensor (a DTensor's shard, a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def splits(placement: Placement) -> bool:
    """Whether a placement cuts the tensor into different pieces across its mesh dimension.

    ``Shard`` does, and so does FSDP2 x TP's ``_StridedShard``, which in torch 2.13 is neither a
    ``Shard`` subclass nor ``is_shard()``: anything that is not a copy (``Replicate``) or a
    partial sum (``Partial``, never a parameter's placement) is a piece.
    """
    return not (placement.is_replicate() or placement.is_partial())


def pieces(p: torch.Tensor) -> int:
    """How many different local pieces ``p`` is cut into (1 for a plain tensor)."""
    if not isinstance(p, DTensor):
        return 1
    n = 1
    for dim, placement in enumerate(p.placements):
        if splits(placement):
            n *= p.device_mesh.size(dim)
    return n


def replicas(p: torch.Tensor, holders: int, split: bool) -> float:
    """How many ranks contribute an identical copy of ``p``'s local values to a SUM.

    Args:
        p: a parameter (or a DTensor of its layout).
        holders: the ranks that hold this parameter (every rank, or a pipeline stage's ranks).
        split: plain tensors are measured by one of their holders only (DDP's split).

    Returns:
        The holders over the pieces for a DTensor: the copies on its own mesh's replicated
        dimensions and on the holders outside its mesh, which hold the same piece (under
        FSDP x TP a parameter left out of the tensor-parallel plan lives on the dp mesh only,
        identical on every tp rank).
    """
    if isinstance(p, DTensor):
        return holders / pieces(p)
    return 1 if split else holders


class _Measured:
    """The parameters this rank measures, their block index and SUM weight, grouped by device."""

    def __init__(self, blocks: Blocks, owned: list[bool], world_size: int, split: bool):
        self.entries: list[tuple[nn.Parameter, int, float]] = []
        for b, params in enumerate(blocks.params):
            # The ranks holding this block's parameters (whole or in pieces): every rank under
            # DDP, FSDP2, HSDP and FSDP x TP, a stage's ranks under pipeline parallelism.
            holders = len(blocks.holders[b]) if blocks.holders else world_size
            for _, p in params:
                if isinstance(p, DTensor) or owned[b]:
                    self.entries.append((p, b, 1.0 / replicas(p, holders, split)))
        self.num_blocks = len(blocks)
        self._key: tuple[int, ...] | None = None
        self._index: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._counted: tuple[tuple[int, ...] | None, list[float]] = (None, [])

    def block_counts(self, positions: list[int]) -> list[float]:
        """How many of the tensors at entry ``positions`` each block has (host values)."""
        key = tuple(positions)
        if key != self._counted[0]:
            counts = [0.0] * self.num_blocks
            for pos in positions:
                counts[self.entries[pos][1]] += 1.0
            self._counted = (key, counts)
        return self._counted[1]

    def block_sums(
        self, tensors: list[torch.Tensor], positions: list[int], device: torch.device
    ) -> torch.Tensor:
        """Per-block sums of squared L2 norms of ``tensors`` (entry ``positions``), float64."""
        out = torch.zeros(self.num_blocks, dtype=F64, device=device)
        if not tensors:
            return out
        key = tuple(positions)
        if key != self._key:
            self._rebuild(tensors, positions)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        for dev, group in by_device.items():
            # Norm per tensor in float32, then combine in float64: one norm over concatenated
            # tensors loses accuracy, and bf16 norms are off by ~3e-3.
            norms = foreach_norm(group, 2, dtype=torch.float32)
            sq = torch.stack(norms).to(F64).square_()
            index, weight = self._index[dev]
            if weight is not None:
                sq.mul_(weight)
            out.index_add_(0, index.to(device, non_blocking=True), sq.to(device, non_blocking=True))
        return out

    def _rebuild(self, tensors: list[torch.Tensor], positions: list[int]) -> None:
        groups: dict[torch.device, tuple[list[int], list[float]]] = {}
        for t, pos in zip(tensors, positions):
            _, block, weight = self.entries[pos]
            idx, w = groups.setdefault(t.device, ([], []))
            idx.append(block)
            w.append(weight)
        self._index = {}
        for dev, (idx, w) in groups.items():
            weights = None if all(x == 1.0 for x in w) else torch.tensor(w, dtype=F64).to(dev)
            self._index[dev] = (torch.tensor(idx, dtype=torch.long).to(dev), weights)
        self._key = tuple(positions)


class GradStats:
    """Per-block sums of squared gradient norms over this rank's share of the gradients.

    ``source``: where a parameter's gradient lives when not in ``.grad`` (the optimizer
    backend's ``grad_source``: a partitioned optimizer keeps this rank's disjoint fragment of
    it: every block is measured, and the SUM of the fragments' squares is the whole's, as for
    FSDP2's shards).
    """

    def __init__(
        self,
        blocks: Blocks,
        owned: list[bool],
        world_size: int,
        split: bool,
        source: GradSource | None = None,
    ):
        if source is not None:
            owned, split = [True] * len(blocks), True  # disjoint fragments: weight 1
        self._measured = _Measured(blocks, owned, world_size, split)
        self._source = source

    @property
    def partitioned(self) -> bool:
        """The gradients are read from a framework's partitions, not from ``param.grad``."""
        return self._source is not None

    def grads(self) -> tuple[list[torch.Tensor], list[int]]:
        tensors, positions = [], []
        for i, (p, _, _) in enumerate(self._measured.entries):
            g = p.grad if self._source is None else self._source(p)
            if g is not None and g.numel():
                tensors.append(local(g))
                positions.append(i)
        return tensors, positions

    def block_sq(self, device: torch.device) -> torch.Tensor:
        return self.measure(device)[0]

    def measure(self, device: torch.device) -> tuple[torch.Tensor, list[float]]:
        """Per-block sums of squares (device, float64) and how many gradient tensors of each
        block this rank read (host floats: a SUM of them that is 0 means no rank read any)."""
        tensors, positions = self.grads()
        return (
            self._measured.block_sums(tensors, positions, device),
            self._measured.block_counts(positions),
        )


class UpdateRatio:
    """||w_new - w_old||^2 and ||w_old||^2 per block, around one optimizer step.

    Memory: a snapshot of the local values of the selected blocks' parameters lives from just
    before ``optimizer.step()`` to just after it, on sampled steps only. Under DDP with the split
    that is this rank's owned blocks; under FSDP2 the local shards. ``max_bytes`` bounds it: when
    the blocks do not fit, successive sampled steps take turns over them.

    ``source``: where this rank's values of a parameter are when the parameter is partitioned
    outside forward (the optimizer backend's ``param_source``: disjoint partitions, every block
    measured, weight 1).
    """

    def __init__(
        self,
        blocks: Blocks,
        owned: list[bool],
        world_size: int,
        split: bool,
        max_bytes: int,
        source: ParamSource | None = None,
    ):
        if source is not None:
            owned, split = [True] * len(blocks), True  # disjoint partitions: weight 1
        self._blocks = blocks
        self._measured = _Measured(blocks, owned, world_size, split)
        self._local = (lambda p: local(p.detach())) if source is None else source
        self._bytes = [
            sum(
                p.numel() * p.element_size() // pieces(p)
                if source is None
                else source(p).numel() * p.element_size()
                for _, p in ps
            )
            for ps in blocks.params
        ]
        self._max_bytes = max_bytes
        self._cursor = 0
        self._snapshot: tuple[list[torch.Tensor], list[int], list[bool]] | None = None

    def select(self) -> list[bool]:
        """The blocks measured this time; identical on every rank (from global sizes only)."""
        n = len(self._bytes)
        chosen, total = [False] * n, 0
        for k in range(n):
            b = (self._cursor + k) % n
            if chosen[b]:
                continue
            if total and total + self._bytes[b] > self._max_bytes:
                break
            chosen[b], total = True, total + self._bytes[b]
        self._cursor = (self._cursor + sum(chosen)) % n
        return chosen

    def before_step(self) -> None:
        chosen = self.select()
        tensors, positions = [], []
        for i, (p, b, _) in enumerate(self._measured.entries):
            if chosen[b]:
                tensors.append(self._local(p))
                positions.append(i)
        # One multi-tensor kernel instead of a clone per parameter; x * 1.0 == x exactly.
        snapshot = foreach_mul(tensors, 1.0) if tensors else []
        self._snapshot = (snapshot, positions, chosen)

    def cancel(self) -> None:
        self._snapshot = None

    def after_step(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, list[bool]] | None:
        """Per-block (||dw||^2, ||w_old||^2) device tensors and the measured mask; frees the
        snapshot."""
        if self._snapshot is None:
            return None
        snapshot, positions, chosen = self._snapshot
        self._snapshot = None
        w_sq = self._measured.block_sums(snapshot, positions, device)
        if snapshot:
            current = [self._local(self._measured.entries[i][0]) for i in positions]
            foreach_sub_(snapshot, current)
        d_sq = self._measured.block_sums(snapshot, positions, device)
        return d_sq, w_sq, chosen
