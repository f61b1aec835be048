"""Every RNG a training step draws from, as JSON-safe data (no pickle in checkpoints).

Torch (CPU, and CUDA when initialised), Python's ``random`` and NumPy's global generator when
NumPy is loaded; each rank has its own states.
"""

from __future__ import annotations

import base64
import hashlib
import random
import sys
from typing import Any

import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": [version, list(internal), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    if (np := sys.modules.get("numpy")) is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def reseed(salt: int) -> None:
    """Move every RNG this rank draws from to a new stream derived from its current state and
    ``salt``: deterministic, distinct per rank when the states were, and not the stream a restored
    state would replay (the random batches a loop draws itself)."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes() + str(salt).encode()).digest()
    seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    torch.manual_seed(seed)  # CUDA generators too
    random.seed(seed)
    if (np := sys.modules.get("numpy")) is not None:
        np.random.seed(seed % (1 << 32))
