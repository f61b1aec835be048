"""The model's and optimizer's state in a checkpoint folder: tensors in DCP's shards, every
non-tensor leaf as JSON beside them.

    write_shards(tmp, live_tensors(model, optimizer), ranks)   # collective: DCP's shards
    read_shards(folder, model, optimizer, ranks)               # collective: loaded in place

DCP would pickle the non-tensor leaves (learning rates, betas, parameter names) into its shards;
each rank writes them as ``plain-rank-<rank>.json`` instead, and a load reads the tensors through
``trust.py``'s reader and planner, which unpickle nothing. Every non-tensor value a checkpoint
keeps is JSON: ``jsonable`` names what JSON cannot hold.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ...records.durable import write_json
from ..jsonsafe import json_safe
from .agreement import CheckpointError, Ranks, describe, failures
from .state import get_states, set_states
from .trust import SafeReader, TensorsOnlyPlanner, merge_plain, split_plain


def write_shards(folder: Path, state: dict[str, Any], ranks: Ranks) -> None:
    """Write this rank's part of ``state`` into ``folder``; collective (DCP's save).

    Args:
        folder: the checkpoint folder being filled.
        state: ``{"model", "optim"}`` state dicts (live tensors or a staged host copy).
        ranks: the ranks that save together.

    Raises:
        CheckpointError: on every rank, when a rank could not write its non-tensor state (a
            leaf JSON cannot hold, a full disk), or DCP's failure (with the bytes left free on
            the folder's filesystem).
    """
    tensors, plain = split_plain(state)

    def write_plain() -> None:  # the non-tensor leaves as JSON: DCP would pickle them
        write_json(
            folder / f"plain-rank-{ranks.rank:05d}.json",
            jsonable(plain, "the model's and optimizer's non-tensor state"),
        )

    # Agreed before DCP's collectives: a rank that failed here alone and skipped them would
    # leave the others waiting inside DCP's plan exchange while it went on to the next phase.
    if errors := failures(ranks.gather(write_plain)):
        raise CheckpointError(f"the non-tensor state: {errors}")
    try:
        with _quiet_single_process():
            dcp.save(
                tensors,
                storage_writer=dcp.FileSystemWriter(folder),
                process_group=ranks.group,
                no_dist=not ranks.distributed,
            )
    except dcp.CheckpointException as e:
        # torch.save inside DCP reports a short write (full disk) as "unexpected pos".
        free = shutil.disk_usage(folder).free
        raise CheckpointError(f"{describe(e)} ({free} bytes free there)") from e


def read_shards(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks
) -> None:
    """Load the model's and optimizer's state from ``folder`` in place; collective (DCP's load).

    Args:
        folder: a verified checkpoint folder.
        model, optimizer: as saved (DCP reshards the tensors to this world's layout).
        ranks: the ranks that load together.

    Raises:
        CheckpointError: on every rank, when a rank could not read the plain state (none there:
            an older, pickling torchvitals wrote the folder).
    """
    plain: list[Any] = []  # kept here: the gather carries only whether each rank read it

    def read_plain() -> None:
        mine = folder / f"plain-rank-{ranks.rank:05d}.json"
        # A world of another size reads rank 0's: the same state.
        for plain_file in (mine, folder / "plain-rank-00000.json"):
            if plain_file.exists():
                plain.append(json.loads(plain_file.read_text()))
                return
        raise CheckpointError(
            f"{folder} has no plain-rank-*.json: written by a torchvitals "
            "that pickled the non-tensor state into DCP's shards, which "
            "this one does not unpickle"
        )

    # Read and agreed before DCP's collective load, for the reason ``write_shards`` gives.
    if errors := failures(ranks.gather(read_plain)):
        raise CheckpointError(f"reading the non-tensor state of {folder}: {errors}")
    model_sd, optim_sd = get_states(model, optimizer)
    tensors, _ = split_plain({"model": model_sd, "optim": optim_sd})
    with _quiet_single_process():
        dcp.load(
            tensors,
            storage_reader=SafeReader(folder),
            planner=TensorsOnlyPlanner(),
            process_group=ranks.group,
            no_dist=not ranks.distributed,
        )
    full = merge_plain(tensors, plain[0])
    set_states(model, optimizer, full["model"], full["optim"])


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns when it saves or loads in one process, which is just what a plain run does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def jsonable(value: Any, where: str) -> Any:
    """``value`` as JSON keeps it, or a CheckpointError naming what JSON cannot hold."""
    try:
        return json_safe(value, strict=where, keep_nonfinite=True)
    except TypeError as e:
        raise CheckpointError(f"{e}; a checkpoint keeps it as JSON") from None
