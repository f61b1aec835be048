"""How many ranks hold identical copies of each block's activations, told once from the values.

    copies = count_copies(counts, sums, maxes, group, world, device)   # collective, once

Under tensor parallelism the ranks of one tensor-parallel group run the forward pass on the same
batch (the batch is split over the data-parallel ranks only). A block whose output is replicated
(after ``RowwiseParallel``, or a module left out of the plan) gives each of them the very same
activations; one whose output is sharded (sequence parallel, ``ColwiseParallel`` with a local
output) gives each a different piece. The hooks see plain local tensors, which carry no
placement, so the layout is read from the values: on the first sampled step every rank shares
its per-block statistics once (element count, the five sums, the abs max, bit for bit), and the
ranks whose statistics are identical hold copies of one activation. Each copy is then weighted by
one over their number, so a replicated activation counts once and a sharded one in full.

Different data gives different sums; only activations that are identical by value (a constant
output cut into pieces, ranks fed the same batch) read as copies, and then every rank's weight in
that block is the same, so the means and fractions are still exact. The weights are kept for the
run: the layout does not change between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

F64 = torch.float64


def count_copies(
    counts: Sequence[float],
    sums: torch.Tensor,
    maxes: torch.Tensor,
    group: dist.ProcessGroup | None,
    world: int,
    device: torch.device,
) -> list[float]:
    """Per block, how many ranks (this one included) recorded exactly this rank's activations.

    Every rank must call it in the same step (one ``all_gather``, and one host copy).

    Args:
        counts: per block, the elements this rank recorded.
        sums: per block, this rank's five sums (``[B, 5]``, float64).
        maxes: per block, this rank's abs max (``[B]``, float64).
        group: the agent's process group.
        world: ranks in ``group``.
        device: where the collective runs (the host for gloo).

    Returns:
        One value per block, 1.0 where this rank recorded nothing.
    """
    rows = torch.cat(
        [torch.tensor(list(counts), dtype=F64).unsqueeze(1), sums.cpu(), maxes.cpu().unsqueeze(1)],
        dim=1,
    )
    # Compared as integers: bit for bit, so a NaN statistic matches its own copy.
    mine = rows.view(torch.int64).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = [t.cpu().tolist() for t in gathered]
    here = mine.cpu().tolist()
    return [
        float(sum(t[b] == row for t in table)) if counts[b] > 0 else 1.0
        for b, row in enumerate(here)
    ]
