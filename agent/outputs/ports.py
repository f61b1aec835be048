"""Which port a rank's /metrics serves on, whoever launched it.

    python -c "from torchvitals.agent.outputs.ports import local_rank; print(local_rank())"

Rank r of a node serves on ``metrics_port + r``, where r is the local rank as the launcher tells
it: torchrun sets ``LOCAL_RANK``, ``srun`` ``SLURM_LOCALID``, Open MPI's ``mpirun``
``OMPI_COMM_WORLD_LOCAL_RANK``, MPICH and Intel MPI ``MPI_LOCALRANKID``. A rank that read none
of them would bind the same port as every other rank on its node.

The default base port, 19400, lies outside 9100-9999, the range Prometheus hands out to
exporters (full since 2023: dcgm-exporter holds 9400, node-exporter 9100, and every port between
belongs to some exporter a node may run), below Linux's ephemeral range (32768-60999) and away
from torchrun's rendezvous (29400) and master (29500) ports.

A port that is taken anyway is not the training's problem: ``candidates`` lists where a rank
tries next. It steps by the node's rank count, so a rank that falls back never takes the port a
sibling of its own job is about to bind, then ends with 0 (any free port the kernel picks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping

log = logging.getLogger(__name__)

DEFAULT_PORT = 19400

LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
"""Where each launcher puts a process's rank on its node, in the order they are read."""

LOCAL_SIZE_VARS = (
    "LOCAL_WORLD_SIZE",
    "SLURM_NTASKS_PER_NODE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
)
"""Where each launcher puts the number of ranks on a node (same order)."""

FALLBACK_STEPS = 4
"""Ports tried after the configured one (one node-width apart) before any free port."""

UNKNOWN_LOCAL_SIZE = 8
"""The node width assumed when no launcher says it: the GPUs of a common node."""


def _first_int(names: tuple[str, ...], env: Mapping[str, str]) -> tuple[int, str] | None:
    for name in names:
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            value = int(raw)
        except ValueError:
            # Slurm writes some counts as "4(x2)"; anything else unreadable is skipped, named.
            log.warning(
                "torchvitals: %s=%r is not an integer; reading the next launcher's variable",
                name,
                raw,
            )
            continue
        if value >= 0:
            return value, name
    return None


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank on its node, from the first launcher variable set (0 without one)."""
    found = _first_int(LOCAL_RANK_VARS, os.environ if env is None else env)
    return 0 if found is None else found[0]


def local_rank_source(env: Mapping[str, str] | None = None) -> str:
    """The variable ``local_rank`` was read from (for messages), or "" when none was set."""
    found = _first_int(LOCAL_RANK_VARS, os.environ if env is None else env)
    return "" if found is None else found[1]


def local_size(env: Mapping[str, str] | None = None) -> int:
    """The number of ranks on this node, as the launcher says (``UNKNOWN_LOCAL_SIZE`` without)."""
    found = _first_int(LOCAL_SIZE_VARS, os.environ if env is None else env)
    return UNKNOWN_LOCAL_SIZE if found is None or found[0] < 1 else found[0]


def candidates(
    base: int, local_rank: int, local_size: int, steps: int = FALLBACK_STEPS
) -> Iterator[int]:
    """The ports a rank tries in order: its own, ``steps`` more one node-width apart, then 0.

    Args:
        base: the configured base port (``metrics_port``).
        local_rank: the rank on its node.
        local_size: ranks on the node (the stride, so fallbacks stay out of siblings' ports).
        steps: how many fallback ports to try before asking the kernel for any free one.
    """
    first = base + local_rank
    yield first
    for k in range(1, steps + 1):
        port = first + k * max(1, local_size)
        if port > 65535:
            break
        yield port
    yield 0
