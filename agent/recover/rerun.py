"""A suspect step computed once more, to tell a transient fault from one that reproduces.

    closures = packer.add_host_sum([1.0 if closure is not None else 0.0])   # every step: 1 float
    ...                                                                      # the step's reduction
    if (outlier := suspect(report, reduced.scalar(closures), world)) is not None:  # every rank
        again = compute(closure, params, report, outlier, device, rank)
        report.rerun = read(again, reducer.reduce(again.packer))            # collective

A one-step loss outlier is usually a bad batch, and the same batch gives the same loss again.
Sometimes it is not the batch but the machine: a flipped bit, a bad kernel, a failing
accelerator on one rank (large runs recompute a suspect step to catch silent data corruption).
When the loop gives ``agent.step(loss, closure=fn)``, ``fn`` recomputing the
forward and backward passes on the same batch and returning the loss (as torch.optim's closures
do), and every rank gave one (one host float in the step's SUM says so), an outlier step is
computed once more on every rank: the gradients are cleared, ``fn`` runs, and one more SUM of
five floats (the recomputed loss, the ranks that knew theirs, and ``[f, r·f, r²·f]`` of "this
rank's own loss was past the culprit cut and is not now") tells every rank whether the outlier
reproduced and whose value changed. One that did not is a ``transient_fault`` naming those
ranks; either way the step's update is dropped (the gradients were the faulty pass's, or the
batch is an outlier itself). Only on a suspect step: that rare path may wait for the device.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..detect.verdict import LOSS_OUTLIER, TRANSIENT_FAULT, WARNING, Verdict
from ..measure import ranksum
from ..measure.reduce import Packer, Reduced, Slot
from ..measure.stats import local
from ..report import Report, Rerun

F64 = torch.float64


def suspect(report: Report, closures: float, world_size: int) -> Verdict | None:
    """The outlier verdict that makes this step worth computing again, when every rank gave a
    closure (``closures``: the SUM of each rank's 1 or 0); None otherwise."""
    if closures < world_size or report.nonfinite:
        return None
    return next((v for v in report.verdicts if v.pattern == LOSS_OUTLIER), None)


@dataclass(frozen=True)
class Again:
    """A re-run packed for its reduction (``compute``), read back by ``read``."""

    packer: Packer
    on_device: Slot
    on_host: Slot
    threshold: float
    start: float


def compute(
    closure: Callable[[], Any],
    params: Sequence[torch.Tensor],
    report: Report,
    outlier: Verdict,
    device: torch.device,
    rank: int,
) -> Again:
    """Compute the step again on this rank and pack what every rank must know of it.

    Args:
        closure: this rank's ``fn``: forward and backward on the step's batch, returning the
            loss (the gradients are cleared before it runs).
        params: the watched parameters (their gradients are cleared).
        report: the step's report (this rank's own loss, as first computed).
        outlier: the ``loss_outlier`` verdict (its median and threshold judge the re-run).
        device: where the packed values live.
        rank: this rank in the reduction's group.

    Returns:
        The packed values: the caller reduces ``again.packer`` (every rank, same step) and
        hands the result to ``read``.
    """
    start = time.perf_counter()
    for p in params:
        p.grad = None
    with torch.enable_grad():
        again = closure()
    median = float(outlier.evidence.get("median", math.nan))
    threshold = float(outlier.evidence.get("threshold", math.nan))
    # A rank whose own loss alone could lift the mean past the threshold (the loss signal's cut).
    cut = median + report.world_size * (threshold - median)
    first = report.local.loss
    # The same layout on every rank whichever kind of loss each returned (the sums are slot by
    # slot): 4 device floats (value, flags) and 5 host ones (value, known, flags).
    packer = Packer(device)
    powers = torch.tensor(ranksum.powers(rank), dtype=F64, device=device)
    if isinstance(again, torch.Tensor):
        value = local(again.detach()).reshape(()).to(F64).to(device)
        changed = float(first > cut) * (value <= cut).to(F64)
        on_device = packer.add_sum(torch.cat([value.reshape(1), changed * powers]))
        on_host = packer.add_host_sum([0.0, 1.0, 0.0, 0.0, 0.0])
    else:
        number = float(again) if again is not None else 0.0
        flag = float(first > cut and again is not None and number <= cut)
        on_device = packer.add_sum(torch.zeros(1 + ranksum.SLOTS, dtype=F64, device=device))
        on_host = packer.add_host_sum(
            [number, 0.0 if again is None else 1.0, *ranksum.encode(rank, flag)]
        )
    return Again(packer, on_device, on_host, threshold, start)


def read(again: Again, reduced: Reduced) -> Rerun:
    """What the re-run came to, the same on every rank, from its reduction."""
    value_sum, *device_flags = reduced[again.on_device]
    number_sum, knew, *host_flags = reduced[again.on_host]
    loss = (value_sum + number_sum) / knew if knew else math.nan
    count, ranks = ranksum.decode(*(a + b for a, b in zip(device_flags, host_flags)))
    return Rerun(
        loss=loss,
        reproduced=not (math.isfinite(loss) and loss <= again.threshold),
        ranks=ranks,
        rank_count=count,
        seconds=time.perf_counter() - again.start,
    )


def transient(report: Report, outlier: Verdict, rerun: Rerun) -> Verdict:
    """The ``transient_fault`` verdict of a re-run that did not reproduce ``outlier``."""
    evidence = {
        "loss": report.loss,
        "rerun_loss": rerun.loss,
        "threshold": outlier.evidence.get("threshold"),
        "median": outlier.evidence.get("median"),
        "ranks": list(rerun.ranks),
        "rank_count": rerun.rank_count,
    }
    return Verdict(TRANSIENT_FAULT, WARNING, report.step, outlier.block, evidence)
