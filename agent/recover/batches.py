"""Resumable, skip-aware batches: a global batch position that lives in the checkpoint.

    for batch in agent.batches(loader):      # the loader as you have it, every epoch
        ...

Every batch drawn from the loader gets the next global index, across epochs. A batch whose
index lies in a skipped range is drawn and dropped (never trained on); after a process restart
the batches before the checkpoint's position are drawn and dropped too, so the job continues at
the right sample as long as the loader yields the same sequence again (a seeded sampler, e.g.
``DistributedSampler`` with ``set_epoch``). Every rank counts the same indices, so every rank
skips the same steps.

A loader with ``state_dict``/``load_state_dict`` -- torchdata's ``StatefulDataLoader``
(``pip install torchvitals[data]``) -- is resumed from its own state in the checkpoint instead, so
a restart reads nothing twice.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeGuard

import torch

from ...records.ledger import SkipRanges


class SkipAwareBatches:
    """The global batch counter, the skip list and the resume point."""

    def __init__(self, position: int = 0, skipped: SkipRanges | None = None):
        self.drawn = 0
        """Batches drawn from the loader by this process, plus those before a resume point."""
        self.resume_at = position
        self.skipped = SkipRanges() if skipped is None else skipped
        """The ranges never yielded: the watchdog's ledger's own (one list, persisted there)."""
        self.used = False
        self._loader: Any = None
        self._loader_state: Any = None

    @property
    def position(self) -> int:
        """Global index of the next batch to draw (what a checkpoint stores)."""
        return max(self.drawn, self.resume_at)

    def rank_state(self) -> dict[str, Any] | None:
        """This rank's stateful loader's position (JSON-safe), or None for a plain loader."""
        if not _stateful(self._loader):
            return None
        return {"loader": _encode(self._loader.state_dict()), "drawn": self.drawn}

    def restore_rank_state(self, state: dict[str, Any] | None) -> None:
        """Resume a stateful loader from ``rank_state`` at the next ``iterate``."""
        if state is not None and "loader" in state:
            self._loader_state = (_decode(state["loader"]), state["drawn"])

    def iterate(self, loader: Iterable[Any]) -> Iterator[Any]:
        """One pass over ``loader``, dropping batches consumed before a resume or skipped."""
        self.used = True
        self._loader = loader
        if self._loader_state is not None and _stateful(loader):
            state, self.drawn = self._loader_state
            loader.load_state_dict(state)  # continues mid-epoch, reading nothing twice
        self._loader_state = None
        for batch in loader:
            index = self.drawn
            self.drawn += 1
            if index < self.resume_at or index in self.skipped:
                continue
            yield batch


class _StatefulLoader(Protocol):
    """A loader that saves and resumes its position (torchdata's ``StatefulDataLoader``)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def _stateful(loader: object) -> TypeGuard[_StatefulLoader]:
    return hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")


def _encode(value: Any) -> Any:
    """JSON-safe copy of a loader state: tensors (a sampler's generator) as base64."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        return {
            "__tensor__": base64.b64encode(data.view(torch.uint8).numpy().tobytes()).decode(),
            "dtype": str(data.dtype).removeprefix("torch."),
            "shape": list(data.shape),
        }
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        raw = bytearray(base64.b64decode(value["__tensor__"]))
        dtype = getattr(torch, value["dtype"])
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(value["shape"]).clone()
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value
