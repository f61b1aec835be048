"""Import-only stand-in for triton.language (see ../README.md)."""

from . import _Any

constexpr = _Any()


def __getattr__(name):
    return _Any()
