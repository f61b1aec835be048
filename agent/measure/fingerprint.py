"""Replica fingerprints: are the DDP replicas' parameters still bitwise identical?

    fp = Fingerprint(blocks)              # once, under DDP
    packer.add_max("replica_fp", fp.pack(device))     # sampled steps: [x, -x] per block
    mismatched = fp.mismatched(layout.get(host, "replica_fp"))   # every rank, same answer
    ranks = fp.name_ranks(mismatched, group, device)   # only when something mismatched

After DDP's all-reduce every replica applies the same update to the same weights, so the
replicas stay bitwise identical; a bit flipped in one rank's memory (silent data corruption), a
rank that skipped a step, or code that writes to one replica's weights breaks that, and nothing
else notices: the gradients stay identical, so the loss looks healthy while the replicas drift.

The fingerprint of a block is the sum of its parameters' raw bits read as integers (an fp32
weight as an int32; fp64 as two int32 halves; bf16/fp16 as int16), each parameter summed in
int32 (wrapping: modulo 2**32), the parameters' sums added per block in int64 and kept modulo
2**52 so float64 holds it exactly. Integer addition modulo 2**32 is exact and associative, so
every rank gets the same number whatever its kernel order or thread count (a float sum would
not promise that), and any single changed element (every change of fewer than 32 bits) changes
its block's sum. The int32 sum runs at the speed of a float sum (1.9 ms for the benchmark's
4.9 M parameters on 2 CPU cores; widening to int64 or float64 while summing took 20-28 ms).
The MAX vector carries ``x`` and ``-x``: ``max(x) == -max(-x)`` holds exactly when every rank's
``x`` is the same, so the comparison costs ``2 * blocks`` floats on
a collective that sampled steps already run. Only when a block differs do the ranks exchange
their values once more (every rank sees the mismatch in the same step, so all take part) to name
the odd rank(s) out.

Under FSDP2 each rank holds different shards: there are no replicas to compare, and nothing is
checked (see docs/patterns.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .blocks import Blocks
from .stats import local, pieces

F64 = torch.float64
_MASK = (1 << 52) - 1  # float64 holds every integer below 2**53 exactly
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
"""Element size -> the integer type whose bits a parameter is read as (8-byte: two halves)."""
_LOW32 = (1 << 32) - 1


class Fingerprint:
    """Per-block integer checksums of this rank's parameters, packed for a MAX comparison.

    Args:
        blocks: the model's blocks; every parameter is read (each rank checks every block).
    """

    def __init__(self, blocks: Blocks):
        self.names = list(blocks.names)
        # A DDP module may hold tensor-parallel DTensors: their pieces differ between the ranks
        # by design, so only parameters every rank holds whole are compared.
        self._params = [
            (p, b)
            for b, ps in enumerate(blocks.params)
            for _, p in ps
            if p.element_size() in _INT and not p.is_complex() and pieces(p) == 1
        ]
        self._index: torch.Tensor | None = None
        self.local: torch.Tensor | None = None
        """This rank's fingerprints of the last ``pack`` (float64, on the device)."""

    def compute(self, device: torch.device) -> torch.Tensor:
        """This rank's per-block fingerprints now (float64, exact integers below 2**52).

        Args:
            device: where the parameters live (the result stays there: no host sync).

        Returns:
            One value per block.
        """
        out = torch.zeros(len(self.names), dtype=torch.int64, device=device)
        if not self._params:
            return out.to(F64)
        if self._index is None or self._index.device != device:
            self._index = torch.tensor([b for _, b in self._params], device=device)
        # One sum per parameter on sampled steps only (77 small kernels on the benchmark model,
        # every sample_every-th step); nothing reaches the host here. The wrapped int32 sums are
        # made non-negative before they are added per block, so the block sum cannot wrap.
        sums = torch.stack([_bits(p).sum(dtype=torch.int32) for p, _ in self._params])
        out.index_add_(0, self._index, sums.to(torch.int64) & _LOW32)
        return (out & _MASK).to(F64)

    def pack(self, device: torch.device) -> torch.Tensor:
        """``[x, -x]`` for the MAX reduction (remembers ``x`` for ``name_ranks``)."""
        self.local = self.compute(device)
        return torch.cat([self.local, -self.local])

    def mismatched(self, reduced: list[float]) -> list[int]:
        """Blocks whose fingerprints differ between ranks, from the reduced ``[max x, max -x]``.

        Args:
            reduced: the MAX-reduced values of ``pack``, on the host.

        Returns:
            Block indices, in block order; empty when every replica agrees.
        """
        n = len(self.names)
        return [b for b in range(n) if reduced[b] != -reduced[n + b]]

    def name_ranks(
        self,
        mismatched: list[int],
        group: dist.ProcessGroup | None,
        world_size: int,
        device: torch.device,
    ) -> dict[str, list[int]]:
        """Which ranks hold the odd fingerprint of each mismatched block (one all_gather).

        Every rank must call it in the same step (they all see the same mismatch). A rank is
        named when its value differs from the value most ranks hold; without a majority (two
        ranks, or a tie) every rank is named: the comparison cannot tell which copy is right.

        Args:
            mismatched: block indices from ``mismatched``.
            group: the process group of the reduction.
            world_size: ranks in ``group``.
            device: where the collective runs (the host for gloo).

        Returns:
            Block name -> the ranks (indices in ``group``) to suspect.
        """
        if self.local is None:
            raise RuntimeError("name_ranks compares the fingerprints of a pack(): none was made")
        mine = self.local[mismatched].to(device)
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered).cpu().tolist()  # rank -> values, the rare step only
        out: dict[str, list[int]] = {}
        for i, b in enumerate(mismatched):
            column = [row[i] for row in table]
            counts = Counter(column).most_common()
            if len(counts) > 1 and counts[0][1] > counts[1][1]:
                out[self.names[b]] = [r for r, v in enumerate(column) if v != counts[0][0]]
            else:
                out[self.names[b]] = list(range(world_size))
        return out


def _bits(p: torch.Tensor) -> torch.Tensor:
    """A parameter's elements as integers of the same bits, flat (a view unless it is strided);
    a replicated DTensor's local copy, read without a DTensor operation (no collective)."""
    return local(p.detach()).reshape(-1).view(_INT[p.element_size()])


def state_fingerprint(params: Iterable[torch.Tensor]) -> int:
    """One integer checksum of this rank's values of ``params`` (its shard of a sharded one):
    each parameter's raw bits summed as integers modulo 2**32, added modulo 2**52, as
    ``Fingerprint`` does per block. Bitwise the same state gives the same number on any device,
    in any kernel order; any changed element (fewer than 32 bits) changes it. One host copy:
    for a save and a restore, not for a step."""
    sums = [
        _bits(p).sum(dtype=torch.int32).to(torch.int64) & _LOW32
        for p in params
        if p.element_size() in _INT and not p.is_complex() and local(p).numel() > 0
    ]
    if not sums:
        return 0
    device = sums[0].device
    return int(torch.stack([s.to(device) for s in sums]).sum().item()) & _MASK
