"""What a block is: the groups of parameters and the modules whose outputs the agent measures.

Automatic discovery follows how models are written: the layers are the children of the
ModuleList/Sequential/ModuleDict that holds most of the parameters (one block per child that has
parameters; parameter-free children such as an activation function join the block before them,
whose output is then measured after them; a ModuleDict counts only when its parameterised
children are all of one class, since a dict of different heads is not a stack of layers, while
torchtitan keeps its repeated layers in one), every embedding is its own block, the last Linear
outside the layers is the head, and every other parameter belongs to "other".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..compat.wrapped import WRAPPER_PREFIXES, full_numel, wrapped_module
from .kinds import EMBEDDING, HEAD, LAYER, NAMED, OTHER


@dataclass
class Blocks:
    """The model's blocks, in a fixed order shared by every rank."""

    names: list[str]
    """Block names (module paths, or the user's names), "other" last when present."""
    params: list[list[tuple[str, nn.Parameter]]]
    """Per block, its (name, parameter) pairs; every parameter appears once."""
    output_modules: list[nn.Module | None]
    """Per block, the module whose output is the block's activation (None for "other")."""
    kinds: list[str] = field(default_factory=list)
    """Per block: "layer" (one of the repeated layers, in depth order), "embedding", "head",
    "named" (the user's) or "other"."""
    paths: list[list[str]] = field(default_factory=list)
    """Per block, the module paths it covers (empty for "other")."""
    numels: list[int] = field(default_factory=list)
    """Per block, the number of elements of its full (unsharded) parameters."""
    holders: list[list[int]] = field(default_factory=list)
    """Per block, the ranks holding the same parameters of it as this rank (its replicas, this
    rank included; empty where this rank holds none of it), set when the ranks agree on their
    blocks (``stages.agree``); empty before: every rank holds every block."""

    def __post_init__(self) -> None:
        self.numels = [sum(_full_numel(p) for _, p in ps) for ps in self.params]

    def __len__(self) -> int:
        return len(self.names)

    def block_of(self, path: str) -> int | None:
        """Index of the block covering the module at ``path`` (longest path prefix), or None."""
        best, best_len = None, -1
        for b, prefixes in enumerate(self.paths):
            for prefix in prefixes:
                if (path == prefix or path.startswith(prefix + ".") or prefix == "") and len(
                    prefix
                ) > best_len:
                    best, best_len = b, len(prefix)
        return best


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers (FSDP2 wraps in place)."""
    while True:
        inner = wrapped_module(model)
        if inner is None:
            return model
        model = inner


def discover(model: nn.Module, named: Mapping[str, Any] | list[str] | None = None) -> Blocks:
    """Group the model's parameters into blocks.

    Args:
        model: the (possibly DDP-wrapped, possibly ``fully_shard``-ed) model.
        named: blocks named by module path (see ``Config.blocks``); None discovers them.

    Returns:
        The Blocks, in an order that depends only on the module structure (so identical on
        every rank).
    """
    root = unwrap(model)
    spec = _normalise_named(named) if named is not None else _auto_spec(root)
    modules = dict(root.named_modules())
    missing = [p for paths, _, _ in spec.values() for p in paths if p not in modules]
    if missing:
        raise ValueError(
            f"torchvitals blocks: no module at path(s) {missing}; "
            f"top-level modules are {[n for n, _ in root.named_children()]}"
        )
    names = list(spec)
    owner: list[list[tuple[str, nn.Parameter]]] = [[] for _ in names]
    other: list[tuple[str, nn.Parameter]] = []
    prefixes = sorted(
        ((path, i) for i, n in enumerate(names) for path in spec[n][0]),
        key=lambda item: -len(item[0]),
    )
    for pname, p in root.named_parameters():
        for path, i in prefixes:
            if path == "" or pname == path or pname.startswith(path + "."):
                owner[i].append((pname, p))
                break
        else:
            other.append((pname, p))
    outputs = [modules[spec[n][1]] if spec[n][1] is not None else None for n in names]
    kinds = [spec[n][2] for n in names]
    paths = [list(spec[n][0]) for n in names]
    keep = [i for i in range(len(names)) if owner[i] or named is not None]
    names = [names[i] for i in keep]
    params = [owner[i] for i in keep]
    outputs = [outputs[i] for i in keep]
    kinds = [kinds[i] for i in keep]
    paths = [paths[i] for i in keep]
    if other:
        names.append(OTHER)
        params.append(other)
        outputs.append(None)
        kinds.append(OTHER)
        paths.append([])
    if not names:
        raise ValueError("torchvitals: the model has no parameters to watch")
    return Blocks(names=names, params=params, output_modules=outputs, kinds=kinds, paths=paths)


def _normalise_named(
    named: Mapping[str, Any] | list[str],
) -> dict[str, tuple[list[str], str | None, str]]:
    """name -> (module paths, path of the module whose output is measured)."""
    if isinstance(named, (list, tuple)):
        named = {_strip(str(p)): str(p) for p in named}
    spec: dict[str, tuple[list[str], str | None, str]] = {}
    for name, paths in named.items():
        paths = [paths] if isinstance(paths, str) else list(paths)
        if not paths:
            raise ValueError(f"torchvitals blocks: block {name!r} names no module")
        if name == OTHER:
            raise ValueError(f"torchvitals blocks: {OTHER!r} is reserved for unassigned parameters")
        spec[str(name)] = ([_strip(p) for p in paths], _strip(paths[-1]), NAMED)
    return spec


def _auto_spec(root: nn.Module) -> dict[str, tuple[list[str], str | None, str]]:
    container = _layers_container(root)
    spec: dict[str, tuple[list[str], str | None, str]] = {}
    inside: set[str] = set()
    if container is not None:
        cpath, cmod = container
        base = cpath + "." if cpath else ""
        modules = dict(root.named_modules())
        groups: list[list[str]] = []
        for cname, child in cmod.named_children():
            if _has_params(child) or not groups:
                groups.append([base + cname])
            else:
                groups[-1].append(base + cname)
        for group in groups:
            if any(_has_params(modules[p]) for p in group):
                spec[group[0]] = ([p for p in group], group[-1], LAYER)
        inside = {p for g in groups for p in g}
    embeddings, head = [], None
    for path, mod in root.named_modules():
        if any(path == p or path.startswith(p + ".") for p in inside) or path == "":
            continue
        if isinstance(mod, nn.Embedding | nn.EmbeddingBag):
            embeddings.append(path)
        elif isinstance(mod, nn.Linear):
            head = path
    blocks = {p: ([p], p, EMBEDDING) for p in embeddings}
    blocks.update(spec)
    if head is not None and head not in blocks:
        blocks[head] = ([head], head, HEAD)
    return blocks


def _layers_container(root: nn.Module) -> tuple[str, nn.Module] | None:
    """The ModuleList/Sequential/ModuleDict whose parameterised children hold the most parameters
    (a ModuleDict only when those children are repeated layers: all of one class)."""
    best, best_size = None, 0
    for path, mod in root.named_modules():
        if not isinstance(mod, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            continue
        children = [c for c in mod.children() if _has_params(c)]
        if len(children) < 2:
            continue
        if isinstance(mod, nn.ModuleDict) and len({type(c) for c in children}) > 1:
            continue
        size = sum(_full_numel(p) for c in children for p in c.parameters())
        if size > best_size:
            best, best_size = (path, mod), size
    return best


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _full_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter (a DTensor's global shape, not its local shard; a
    DeepSpeed ZeRO-3 parameter's, not its empty placeholder)."""
    return full_numel(p)


def _strip(path: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if path.startswith(prefix):
                path, changed = path[len(prefix) :], True
    return path
