"""What a DCP checkpoint's ``.metadata`` pickle may name: the globals the restricted unpickler
in ``recover/trust.py`` lets it build, bound here against the installed torch.

    DCP_METADATA_GLOBALS[("torch.distributed.checkpoint.metadata", "Metadata")]   # the class

``problems()`` saves a small state dict with DCP and reads its ``.metadata`` back, so a torch
whose metadata names a global missing from the table fails ``check()``, naming it, instead of
every checkpoint being refused as untrusted at run time.
"""

from __future__ import annotations

import collections
import pathlib
import pickle
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata

from .versions import bind

DCP_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): bind(
            _dcp_metadata, name, "torch.distributed.checkpoint.metadata"
        )
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): bind(
        _dcp_filesystem, "_StorageInfo", "torch.distributed.checkpoint.filesystem"
    ),
    ("torch.serialization", "_get_layout"): bind(
        torch.serialization, "_get_layout", "torch.serialization"
    ),
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
}
"""The only globals a DCP ``.metadata`` pickle of torch 2.13 names (plus torch's dtypes, found
by name): everything the restricted unpickler in ``recover/trust.py`` lets it build."""
DCP_METADATA_FILE = ".metadata"
"""DCP's metadata file in a checkpoint folder (one writer: the coordinator)."""


class _Recording(pickle.Unpickler):
    """Unpickles as usual, noting every global the pickle names."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.named: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.named.add((module, name))
        return super().find_class(module, name)


def problems() -> list[str]:
    """Each global a fresh DCP ``.metadata`` names outside the table, as a sentence naming it."""
    with tempfile.TemporaryDirectory() as folder:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save(
                {"w": torch.zeros(2, 3), "x": {"step": 1, "m": torch.ones(2)}},
                checkpoint_id=folder,
                no_dist=True,
            )
        with open(Path(folder) / DCP_METADATA_FILE, "rb") as f:
            reader = _Recording(f)
            reader.load()
    unknown = {
        (module, name)
        for module, name in reader.named
        if (module, name) not in DCP_METADATA_GLOBALS
        and not (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
    }
    return [
        f"a DCP .metadata of torch {torch.__version__} names {module}.{name}, which "
        "recover/trust.py's unpickler does not allow"
        for module, name in sorted(unknown)
    ]
