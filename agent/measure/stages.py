"""The blocks every rank packs, when the ranks hold different parts of the model (pipeline stages).

    blocks, static = agree(blocks, static, group, rank, world)   # once, at watch(); collective

Under data parallelism (DDP, FSDP2) every rank discovers the same blocks. Under pipeline
parallelism each rank holds its stage's layers only: rank 0 the embedding and the first layers,
the last rank the last layers, the norm and the head. The step's one SUM needs one layout on every
rank, so the blocks become the union over the ranks, in rank order (the stages' order), "other"
last, each rank contributing zeros for the blocks it does not hold; the SUM then adds each
block's squares from the ranks that hold it. Which ranks hold the same parameters of a block
(its replicas: a stage's data-parallel copies) is recorded per block, so DDP-style work splitting
and the replica weights stay exact. Blocks with the same name but different parameters (the
"other" of two stages) are different contributions, told apart by a digest of their parameter
names and shapes.

The wiring verdicts (parameters frozen or left out of the optimizer, found before any step) are
agreed the same way: every rank reports the union, so no decision depends on which rank looked.
The ranks holding identical blocks form one stage; stragglers are judged among a stage's ranks
(a pipeline's stages differ in compute by design).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch.distributed as dist

from ...errors import TorchvitalsError
from ..detect.verdict import Verdict
from .blocks import OTHER, Blocks


@dataclass(frozen=True)
class Listing:
    """What one rank says about one of its blocks."""

    name: str
    kind: str
    numel: int
    digest: str
    """Of the block's parameter names and global shapes: equal on the ranks holding the same
    parameters (replicas)."""


class Agreed(NamedTuple):
    """What every rank packs, and where this rank stands among the stages."""

    blocks: Blocks
    static: list[Verdict]
    stage: int
    """This rank's stage (ranks with identical blocks share one), in rank order of first rank."""
    stage_sizes: list[int]
    """How many ranks each stage has (one stage, of every rank, without pipeline parallelism)."""


def _listing(blocks: Blocks) -> list[Listing]:
    out = []
    for name, kind, numel, params in zip(blocks.names, blocks.kinds, blocks.numels, blocks.params):
        text = ";".join(f"{n}:{tuple(p.shape)}" for n, p in params)
        out.append(Listing(name, kind, numel, hashlib.sha256(text.encode()).hexdigest()[:16]))
    return out


def agree(
    blocks: Blocks, static: list[Verdict], group: dist.ProcessGroup | None, rank: int, world: int
) -> Agreed:
    """The blocks (and wiring verdicts) every rank packs; collective when ``world`` > 1.

    Args:
        blocks: this rank's discovered blocks.
        static: this rank's wiring verdicts (``detect.wiring.wiring_verdicts``).
        group: the agent's process group.
        rank, world: this rank in it, and its size.

    Returns:
        The blocks, extended to the union (this rank's ``params`` empty for the blocks it does
        not hold) with ``holders`` set, the union of every rank's wiring verdicts, and the
        stages.

    Raises:
        TorchvitalsError: on every rank, when two ranks name one block with different kinds (not
            one model split into stages: a mismatched watch()).
    """
    mine = _listing(blocks)
    if world == 1:
        return Agreed(replace(blocks, holders=[[0] for _ in blocks.names]), static, 0, [1])
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (mine, static), group=group)
    listings = [entry[0] for entry in everyone]
    if all(listing == mine for listing in listings):  # data parallel: one layout already
        return Agreed(
            replace(blocks, holders=[list(range(world)) for _ in blocks.names]), static, 0, [world]
        )
    layouts: list[list[Listing]] = []
    for listing in listings:
        if listing not in layouts:
            layouts.append(listing)
    stage_sizes = [sum(listing == layout for listing in listings) for layout in layouts]
    order: list[str] = []
    kinds: dict[str, str] = {}
    numels: dict[str, dict[str, int]] = {}  # name -> digest -> numel
    holders: dict[tuple[str, str], list[int]] = {}
    for r, listing in enumerate(listings):
        for item in listing:
            if item.name not in kinds:
                kinds[item.name] = item.kind
                order.append(item.name)
            elif kinds[item.name] != item.kind:
                raise TorchvitalsError(
                    f"torchvitals: rank {r} calls block {item.name!r} a {item.kind}, an earlier "
                    f"rank a {kinds[item.name]}: the ranks watch different models. Every rank "
                    f"must watch its part of one model (pipeline stages) or the same model"
                )
            numels.setdefault(item.name, {})[item.digest] = item.numel
            holders.setdefault((item.name, item.digest), []).append(r)
    if OTHER in order:
        order.remove(OTHER)
        order.append(OTHER)
    at = {name: i for i, name in enumerate(blocks.names)}
    digest = {item.name: item.digest for item in mine}
    merged = Blocks(
        names=order,
        params=[blocks.params[at[n]] if n in at else [] for n in order],
        output_modules=[blocks.output_modules[at[n]] if n in at else None for n in order],
        kinds=[kinds[n] for n in order],
        paths=[blocks.paths[at[n]] if n in at else [] for n in order],
    )
    merged.numels = [sum(numels[n].values()) for n in order]
    merged.holders = [holders[(n, digest[n])] if n in digest else [] for n in order]
    agreed: dict[tuple[str, str | None], Verdict] = {}
    for _, theirs in everyone:
        for verdict in theirs:
            agreed.setdefault((verdict.pattern, verdict.block), verdict)
    return Agreed(merged, list(agreed.values()), layouts.index(mine), stage_sizes)
