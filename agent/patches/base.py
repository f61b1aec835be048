"""The mechanics of a patch: one attribute replaced, and put back only while it is still ours.

    patch = AttributePatch(owner, "step", lambda original: replacement_calling(original))
    patch.install()          # under LOCK; owner held weakly
    patch.uninstall()        # puts back what it found, or warns (ForeignPatchWarning) and leaves
                             # a newer replacement in place; idempotent

``WeakBound`` is the weak reference to a bound method that every route holds, so nothing a patch
keeps reaches the agent. The lock is reentrant: a finalizer can run from a garbage collection
triggered inside a locked section on the same thread.
"""

from __future__ import annotations

import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from ...errors import TorchvitalsError

LOCK = threading.RLock()
"""Held by every install and uninstall, and by every change to a shared patch's leases or routes."""
_MISSING = object()


class ForeignPatchWarning(RuntimeWarning):
    """An attribute torchvitals patched was replaced by someone else since; left in place."""


class AttributePatch:
    """``owner.name`` replaced by ``wrap(current value)``; put back only while still ours.

    The owner is held weakly (an optimizer's patch must not keep the optimizer alive); the
    value found at install time and the replacement are held strongly.

    Args:
        owner: the object, class or module whose attribute is replaced.
        name: the attribute.
        wrap: builds the replacement from the value ``getattr(owner, name)`` has at install.
    """

    def __init__(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        self._owner = weakref.ref(owner)
        self._where = (
            f"{_describe(owner)}.{name}"
            if isinstance(owner, (type, types.ModuleType))
            else f"{type(owner).__qualname__}.{name} (of one instance)"
        )
        self.name, self._wrap = name, wrap
        self.installed = False
        """True from ``install`` until ``uninstall``."""
        self.wrapped: Any = None
        """What the attribute resolved to at install (the replacement calls it through)."""
        self.replacement: Any = None
        self._before: Any = _MISSING  # the owner's own entry at install (not an inherited one)

    def install(self) -> None:
        """Replace the attribute (once; a second call is an error)."""
        with LOCK:
            if self.installed or self.replacement is not None:
                raise TorchvitalsError(f"{self._where} is already patched by this patch")
            owner = self._owner()
            self._before = vars(owner).get(self.name, _MISSING)
            self.wrapped = getattr(owner, self.name)
            self.replacement = self._wrap(self.wrapped)
            setattr(owner, self.name, self.replacement)
            self.installed = True

    def uninstall(self) -> bool:
        """Put back what the attribute was, if it is still our replacement; idempotent.

        Returns:
            False when someone replaced the attribute since (warned, left in place).
        """
        with LOCK:
            if not self.installed:
                return True
            self.installed = False
            owner = self._owner()
            if owner is None:
                return True
            now = vars(owner).get(self.name, _MISSING)
            if now is self.replacement:
                if self._before is _MISSING:
                    delattr(owner, self.name)
                else:
                    setattr(owner, self.name, self._before)
                return True
            if _same(now, self._before) or (
                self._before is _MISSING and _rebound_inherited(owner, self.name, now)
            ):
                return True  # someone already put the original back (accelerate does)
            warnings.warn(
                ForeignPatchWarning(
                    f"torchvitals: {self._where} was replaced after torchvitals patched it; "
                    "leaving the newer one in place (torchvitals' replacement inside it now "
                    "passes every call through)"
                ),
                stacklevel=3,
            )
            return False


def _describe(owner: type | types.ModuleType) -> str:
    return getattr(owner, "__qualname__", None) or owner.__name__


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return (
        isinstance(a, types.MethodType)
        and isinstance(b, types.MethodType)
        and a.__func__ is b.__func__
        and a.__self__ is b.__self__
    )


def _rebound_inherited(owner: Any, name: str, value: Any) -> bool:
    """``value`` is the class's own method bound to ``owner`` (what ``owner.name`` read anyway)."""
    return (
        isinstance(value, types.MethodType)
        and value.__self__ is owner
        and value.__func__ is getattr(type(owner), name, None)
    )


class WeakBound:
    """A weak reference to a bound method's object (the agent) and its function: calling it
    gives the bound method, or None once the object is gone. ``weakref.WeakMethod`` would do,
    but its callbacks can fail noisily when the method's object and the reference die in one
    collection."""

    __slots__ = ("_func", "_ref")

    def __init__(self, method: Callable[..., Any]) -> None:
        if not isinstance(method, types.MethodType):
            raise TypeError(f"a route must be a bound method (held weakly), got {method!r}")
        self._ref, self._func = weakref.ref(method.__self__), method.__func__

    def __call__(self) -> Callable[..., Any] | None:
        obj = self._ref()
        return None if obj is None else types.MethodType(self._func, obj)
