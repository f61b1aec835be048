"""The torch releases torchvitals runs on, and the error every compat module raises.

    too_old("2.12.1")        # why that torch is refused, or None
    supported_range()        # "torch>=2.13.0a0 (tested: 2.13.x, 2.14.x)"

Importing this module (every other compat module does, first) refuses a torch older than
``MIN_TORCH`` with ``CompatError`` naming the version and the supported range, and warns on a
torch newer than the series ``.ci/run`` tests, since its private names may well still hold.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.torch_version import TorchVersion

from ...errors import TorchvitalsError

SUPPORTED_TORCH = "2.13"
"""The oldest torch release series supported."""
MIN_TORCH = "2.13.0a0"
"""``pyproject.toml``'s floor (``torch>=2.13.0a0``): the ``a0`` admits local and pre-release
builds of 2.13 such as NGC's ``2.13.0a0+git1a2b3c4``; there is no upper bound."""
TESTED_TORCH = ("2.13", "2.14")
"""The series .ci/run tests (2.13 the whole suite, 2.14 the unit tier)."""


class CompatError(TorchvitalsError, RuntimeError):
    """A private torch or framework name torchvitals relies on is missing or changed."""


def supported_range() -> str:
    """``"torch>=2.13.0a0 (tested: 2.13.x, 2.14.x)"``: what messages name."""
    return f"torch>={MIN_TORCH} (tested: {', '.join(s + '.x' for s in TESTED_TORCH)})"


def missing(where: str, name: str) -> str:
    """The sentence a problem reads: ``where.name``, the torch version, the supported range."""
    return f"{where}.{name} (torch {torch.__version__}; torchvitals supports {supported_range()})"


def bind(owner: Any, name: str, where: str) -> Any:
    """``owner.name``, bound at import: a missing one refuses the import with ``CompatError``."""
    if not hasattr(owner, name):
        raise CompatError(f"torchvitals needs {missing(where, name)}: it is gone")
    return getattr(owner, name)


def torch_series(version: str = torch.__version__) -> str:
    """``"2.13"`` of ``"2.13.0+cpu"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def too_old(version: str | None = None) -> str | None:
    """Why torchvitals refuses torch ``version`` (default: the one imported), or None when it is
    not older than ``MIN_TORCH`` (local and pre-release versions compare as PEP 440 says)."""
    version = torch.__version__ if version is None else version
    if TorchVersion(version) < MIN_TORCH:
        return (
            f"torch {version} is older than torchvitals supports: it needs "
            f"{supported_range()}; install a newer torch (pip install 'torch>={MIN_TORCH}')"
        )
    return None


def problems() -> list[str]:
    """The torch imported, when older than ``MIN_TORCH`` (read at call time: a test may set it)."""
    return [reason] if (reason := too_old()) else []


if (_refused := too_old()) is not None:
    raise CompatError(_refused)
if torch_series() not in TESTED_TORCH:
    warnings.warn(
        f"torchvitals is tested on {', '.join(s + '.x' for s in TESTED_TORCH)}, this is "
        f"torch {torch.__version__}: run torchvitals.agent.compat.check()",
        stacklevel=2,
    )
