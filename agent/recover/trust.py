"""What makes a checkpoint folder safe to load: a signed manifest, and loading that runs no code.

    key = CheckpointKey.from_env()               # TORCHVITALS_CHECKPOINT_KEY(_FILE), or ~/.config
    manifest["signature"] = key.sign(manifest)       # rank 0, when it commits a save
    key.verify(manifest)                             # None, or why the folder must not be loaded

The checkpoint folder is an input from outside the process: anyone who can write it can plant
files in it, and a SHA-256 manifest they can recompute proves nothing. So:

- the manifest is signed with HMAC-SHA256 under a per-job secret that the folder does not hold
  (``TORCHVITALS_CHECKPOINT_KEY``, or the file ``TORCHVITALS_CHECKPOINT_KEY_FILE`` names, or a
  key made once per user in ``~/.config/torchvitals/checkpoint.key``); a folder whose manifest is
  unsigned or signed under another key is refused unless ``trust_unsigned_checkpoints`` is set;
- loading unpickles nothing torchvitals did not choose to build: DCP's ``.metadata`` goes through
  an unpickler that knows only DCP's metadata classes, tensors are read by DCP with
  ``weights_only=True``, and every non-tensor leaf of the model and optimizer state (learning
  rates, betas, parameter names) is kept in JSON beside the shards instead of DCP's pickled
  bytes items, which a load refuses outright.

A multi-node job must give every node the same key (the chart's example job does, from a
Secret); a key mismatch is a refusal that names the folder, never a silent load.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import pickle
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ...errors import TorchvitalsError
from ..compat.dcp import DCP_METADATA_FILE, DCP_METADATA_GLOBALS

KEY_ENV = "TORCHVITALS_CHECKPOINT_KEY"
KEY_FILE_ENV = "TORCHVITALS_CHECKPOINT_KEY_FILE"
DEFAULT_KEY_FILE = "~/.config/torchvitals/checkpoint.key"
SIGNATURE = "signature"


class UntrustedCheckpoint(TorchvitalsError, RuntimeError):
    """A checkpoint holds what torchvitals will not load (an object pickle, a foreign class)."""


class CheckpointKey:
    """The secret that signs this job's checkpoint manifests.

    Args:
        secret: the key bytes (at least 16).
        source: where it came from, for messages (never the key itself).
    """

    def __init__(self, secret: bytes, source: str) -> None:
        if len(secret) < 16:
            raise ValueError(
                f"the checkpoint key from {source} is {len(secret)} bytes; need at "
                "least 16 (e.g. `openssl rand -hex 32`)"
            )
        self._secret, self.source = secret, source

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, key_file: str | None = None
    ) -> CheckpointKey:
        """The key from ``TORCHVITALS_CHECKPOINT_KEY``, else the file ``key_file`` or
        ``TORCHVITALS_CHECKPOINT_KEY_FILE`` names, else the per-user default file (made, mode
        0600, when missing).

        Raises:
            ValueError: a named key file cannot be read, or a key is too short.
        """
        environ = os.environ if environ is None else environ
        if environ.get(KEY_ENV):
            return cls(environ[KEY_ENV].strip().encode(), KEY_ENV)
        named = key_file or environ.get(KEY_FILE_ENV)
        path = Path(os.path.expanduser(named or DEFAULT_KEY_FILE))
        if named is None and not path.exists():
            _make_key_file(path)
        try:
            secret = path.read_bytes().strip()
        except OSError as exc:
            setting = (
                "checkpoint_key_file"
                if key_file
                else KEY_FILE_ENV
                if named
                else "the default checkpoint key file"
            )
            raise ValueError(f"{setting} {path} cannot be read: {exc.strerror or exc}") from None
        return cls(secret, str(path))

    def sign(self, manifest: Mapping[str, Any]) -> str:
        """The manifest's signature (over everything in it but the signature)."""
        return hmac.new(self._secret, _canonical(manifest), hashlib.sha256).hexdigest()

    def verify(self, manifest: Mapping[str, Any]) -> str | None:
        """None when ``manifest`` is signed with this key, else why it is not trusted."""
        signature = manifest.get(SIGNATURE)
        if not isinstance(signature, str):
            return (
                "the manifest is unsigned (written before torchvitals signed its "
                "checkpoints, or by hand)"
            )
        if not hmac.compare_digest(signature, self.sign(manifest)):
            return (
                f"the manifest's signature does not verify under the key from {self.source} "
                "(another job's checkpoint, a different key on this node, or altered)"
            )
        return None


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _make_key_file(path: Path) -> None:
    """A new random key at ``path``, mode 0600, appearing whole (written aside, then linked: a
    process that finds the file never reads it half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process of this user made it first: use theirs
    finally:
        os.unlink(tmp)


# ---------------------------------------------------------------- loading without code


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch's dtypes and sizes, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        found = DCP_METADATA_GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedCheckpoint(
            f"{DCP_METADATA_FILE} names {module}.{name}, which DCP's "
            "metadata never holds: refused, not unpickled"
        )


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose ``.metadata`` goes through the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / DCP_METADATA_FILE
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except UntrustedCheckpoint:
            raise
        except Exception as exc:
            raise UntrustedCheckpoint(
                f"{path} is not DCP metadata ({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(
            metadata, DCP_METADATA_GLOBALS[("torch.distributed.checkpoint.metadata", "Metadata")]
        ):
            raise UntrustedCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = DCP_METADATA_GLOBALS[
                ("torch.distributed.checkpoint.metadata", "StorageMeta")
            ]()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing the pickled objects DCP would ``torch.load`` unrestricted."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise UntrustedCheckpoint(
            f"{read_item.dest_index.fqn} is a pickled object in the "
            "shards; torchvitals loads tensors only"
        )


# ---------------------------------------------------------------- tensors to DCP, the rest to JSON


def split_plain(tree: Any) -> tuple[Any, Any]:
    """``(tensors, plain)`` of a nested state dict: ``tensors`` keeps only the tensor leaves
    (lists become dicts keyed by index, so DCP's flattened names are the same), ``plain`` the
    whole structure with each tensor leaf replaced by None (JSON-able for the usual state)."""
    if isinstance(tree, torch.Tensor):
        return tree, None
    if isinstance(tree, Mapping):
        tensors: dict[Any, Any] = {}
        plain: dict[Any, Any] = {}
        for key, value in tree.items():
            t, p = split_plain(value)
            if t is not None:
                tensors[key] = t
            plain[key] = p
        return (tensors or None), {"__dict__": plain}
    if isinstance(tree, (list, tuple)):
        indexed: dict[str, Any] = {}
        items: list[Any] = []
        for i, value in enumerate(tree):
            t, p = split_plain(value)
            if t is not None:
                indexed[str(i)] = t
            items.append(p)
        return (indexed or None), {"__list__": items, "tuple": isinstance(tree, tuple)}
    return None, {"value": tree}


def merge_plain(tensors: Any, plain: Any) -> Any:
    """The state dict ``split_plain`` took apart, from its (loaded) tensors and its plain part."""
    if plain is None:
        return tensors
    if "__dict__" in plain:
        return {
            key: merge_plain(_child(tensors, key), value)
            for key, value in plain["__dict__"].items()
        }
    if "__list__" in plain:
        items = [
            merge_plain(_child(tensors, str(i)), value) for i, value in enumerate(plain["__list__"])
        ]
        return tuple(items) if plain.get("tuple") else items
    return plain["value"]


def _child(tensors: Any, key: str) -> Any:
    return tensors.get(key) if isinstance(tensors, dict) else None
