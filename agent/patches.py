"""Every attribute torchvitals replaces on someone else's object, installed and undone here.

    patches = PatchSet()
    patches.close_when_collected(agent)          # undone if the agent is dropped without close()
    patches.replace_step(optimizer, guard.guarded_step)         # optimizer.step (this instance)
    patches.before_zero_grad(optimizer, agent.settle_skipped)    # optimizer.zero_grad (this instance)
    patches.before_model_zero_grad(model, agent.settle_skipped)  # Module.zero_grad (the class)
    patches.route_scaler_step(optimizer, agent._scaler_step)    # GradScaler.step (the class)
    patches.capture_clipping(agent.capture_gradients, params)   # clip_grad's scaling (module)
    ...
    patches.close()                              # idempotent

Three scopes: the optimizer instance's ``step`` and ``zero_grad`` (one agent's), the class
attributes ``GradScaler.step`` and ``Module.zero_grad`` and the module globals that
``clip_grad_norm_`` scales through (shared by every agent in the process: installed by the first,
reference-counted, put back by the last).
Each patch installs under one lock and puts back the value it found only while the attribute
still holds its own replacement. When something replaced it since (a profiler's wrapper, a
user's, a framework's), it warns (``ForeignPatchWarning``) and leaves that one in place; the
wrapper it buried keeps working, passing every call through to what it wrapped.

The shared patches route a call to an agent through a weak reference to it, and
a ``PatchSet`` holds nothing that reaches the agent, so an agent dropped with its model and
optimizer, without ``close()``, is collected, and ``close_when_collected``'s finalizer then
releases its routes and, with the last agent, the shared patches. A route whose agent is gone
is inert in the meantime: the call takes torch's own path.

The lock is reentrant: a finalizer can run from a garbage collection triggered inside a locked
section on the same thread. Private torch names come from ``compat``.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import TorchvitalsError
from .compat import CLIP_SCALE, GradScaler, clip_grad, mark_step_wrapped, wrapped_module

DEEPSPEED_ENGINE = "deepspeed.runtime.engine"
"""The module whose ``clip_grad_norm_`` global DeepSpeed's engine clips through (ZeRO off)."""
MAX_WRAPPERS = 4
"""Module wrappers looked through from a ``zero_grad()`` call (accelerate's DDP around a
compiled model is two)."""

_lock = threading.RLock()
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
        self._where = (f"{_describe(owner)}.{name}" if isinstance(owner, (type, types.ModuleType))
                       else f"{type(owner).__qualname__}.{name} (of one instance)")
        self.name, self._wrap = name, wrap
        self.installed = False
        """True from ``install`` until ``uninstall``."""
        self.wrapped: Any = None
        """What the attribute resolved to at install (the replacement calls it through)."""
        self.replacement: Any = None
        self._before: Any = _MISSING      # the owner's own entry at install (not an inherited one)

    def install(self) -> None:
        """Replace the attribute (once; a second call is an error)."""
        with _lock:
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
        with _lock:
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
            if _same(now, self._before) or (self._before is _MISSING and
                                            _rebound_inherited(owner, self.name, now)):
                return True       # someone already put the original back (accelerate does)
            warnings.warn(ForeignPatchWarning(
                f"torchvitals: {self._where} was replaced after torchvitals patched it; "
                f"leaving the newer one in place (torchvitals' replacement inside it now passes "
                f"every call through)"), stacklevel=3)
            return False


def _describe(owner: type | types.ModuleType) -> str:
    return getattr(owner, "__qualname__", None) or owner.__name__


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return (isinstance(a, types.MethodType) and isinstance(b, types.MethodType)
            and a.__func__ is b.__func__ and a.__self__ is b.__self__)


def _rebound_inherited(owner: Any, name: str, value: Any) -> bool:
    """``value`` is the class's own method bound to ``owner`` (what ``owner.name`` read anyway)."""
    return (isinstance(value, types.MethodType) and value.__self__ is owner
            and value.__func__ is getattr(type(owner), name, None))


class _WeakBound:
    """A weak reference to a bound method's object (the agent) and its function: calling it
    gives the bound method, or None once the object is gone. ``weakref.WeakMethod`` would do,
    but its callbacks can fail noisily when the method's object and the reference die in one
    collection."""

    __slots__ = ("_ref", "_func")

    def __init__(self, method: Callable[..., Any]) -> None:
        if not isinstance(method, types.MethodType):
            raise TypeError(f"a route must be a bound method (held weakly), got {method!r}")
        self._ref, self._func = weakref.ref(method.__self__), method.__func__

    def __call__(self) -> Callable[..., Any] | None:
        obj = self._ref()
        return None if obj is None else types.MethodType(self._func, obj)


# ---------------------------------------------------------------- shared patches


@dataclass(eq=False)
class _Generation:
    """One installation of a shared patch; its wrappers pass through once it is not live."""

    live: bool = True
    patches: list[AttributePatch] = field(default_factory=list)


class SharedPatch:
    """Patches that every agent in the process shares: installed with the first lease,
    uninstalled with the last. Subclasses build them in ``_make``."""

    def __init__(self) -> None:
        self._leases = 0
        self._generation: _Generation | None = None

    @property
    def installed(self) -> bool:
        return self._generation is not None

    def _make(self, generation: _Generation) -> list[AttributePatch]:
        """The attribute patches of one installation (each shared patch says which)."""
        raise NotImplementedError(f"{type(self).__name__} must say what it patches")

    def _acquire(self) -> None:
        with _lock:
            if self._leases == 0:
                generation = _Generation()
                generation.patches = self._make(generation)
                try:
                    for patch in generation.patches:
                        patch.install()
                except BaseException:
                    generation.live = False
                    for patch in generation.patches:
                        patch.uninstall()
                    raise
                self._generation = generation
            self._leases += 1

    def _release(self) -> None:
        with _lock:
            self._leases -= 1
            if self._leases == 0 and self._generation is not None:
                generation, self._generation = self._generation, None
                generation.live = False
                for patch in generation.patches:
                    patch.uninstall()


class Lease:
    """One holder's share of a ``SharedPatch``; ``release()`` is idempotent."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        with _lock:
            release, self._release = self._release, None
        if release is not None:
            release()


class ScalerStepPatch(SharedPatch):
    """``GradScaler.step(optimizer)`` sent to the handler routed for that optimizer.

    ``scaler.step(optimizer)`` skips ``optimizer.step()`` altogether when it finds Inf/NaN
    gradients, so a loop or framework that steps through a GradScaler (nanoGPT's fp16 path,
    Lightning's ``16-mixed``, accelerate's fp16) would hide every overflow step from the agent.
    Routed, every such call runs ``handler(scaler)``: the agent's step with that scaler. The
    class attribute is replaced (torch's CPU, CUDA and FSDP scalers inherit it), so a scaler
    made before or after ``watch`` is reached; other optimizers, disabled scalers and routes
    whose handler is gone keep the scaler's own step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._routes: dict[int, tuple[Any, Any]] = {}

    def route(self, optimizer: torch.optim.Optimizer, handler: Callable[[Any], Any]) -> Lease:
        """Send ``scaler.step(optimizer)`` to ``handler(scaler)`` until the lease is released.

        Args:
            optimizer: the watched optimizer (held weakly).
            handler: a bound method (held weakly), called with the scaler.

        Returns:
            The lease; its release removes the route (and, the last one, the patch).
        """
        entry = (weakref.ref(optimizer), _WeakBound(handler))
        key = id(optimizer)
        with _lock:
            self._acquire()
            self._routes[key] = entry

        def release() -> None:
            with _lock:
                if self._routes.get(key) is entry:
                    del self._routes[key]
                self._release()

        return Lease(release)

    def handler_for(self, optimizer: Any) -> Callable[[Any], Any] | None:
        """The live handler routed for ``optimizer``, or None."""
        entry = self._routes.get(id(optimizer))
        if entry is None or entry[0]() is not optimizer:
            return None
        return entry[1]()

    def _make(self, generation: _Generation) -> list[AttributePatch]:
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                handler = self.handler_for(optimizer) if generation.live else None
                if handler is None or not scaler.is_enabled():
                    return original(scaler, optimizer, *args, **kwargs)
                if "closure" in kwargs or any(a is not None for a in args):
                    raise TorchvitalsError("GradScaler.step(optimizer, closure) is not "
                                           "supported: torch's GradScaler refuses closures too")
                return handler(scaler)
            return step

        return [AttributePatch(GradScaler, "step", wrap)]


class ClippingPatch(SharedPatch):
    """A capture called before gradient clipping scales some of its parameters' gradients.

    ``torch.nn.utils.clip_grad_norm_`` computes the total norm, then calls
    ``clip_grad._clip_grads_with_norm_`` through its module's globals to scale the gradients:
    replacing that global reaches every caller of ``clip_grad_norm_``, however it was imported
    (Lightning's precision plugins, accelerate, nanoGPT, a name imported before ``watch``).
    torchtitan-style code that calls ``torch.nn.utils.clip_grads_with_norm_`` itself is reached
    through that attribute, DeepSpeed's engine (ZeRO off) through its module's ``clip_grad_norm_``
    (under ZeRO-1/2 the agent's step runs before DeepSpeed's, which clips its partitions).
    Clipping by any other means is not seen (``guard.ClipWatch`` flags what that hides).
    """

    def __init__(self) -> None:
        super().__init__()
        self._captures: list[tuple[Any, frozenset[int]]] = []

    def capture(self, fn: Callable[[], None], params: list[torch.Tensor]) -> Lease:
        """Call ``fn()`` before clipping scales any of ``params``, until the lease is released.

        Args:
            fn: a bound method (held weakly).
            params: the parameters whose clipping it cares about.

        Returns:
            The lease; its release removes the capture (and, the last one, the patch).
        """
        entry = (_WeakBound(fn), frozenset(id(p) for p in params))
        with _lock:
            self._acquire()
            self._captures.append(entry)

        def release() -> None:
            with _lock:
                if entry in self._captures:
                    self._captures.remove(entry)
                self._release()

        return Lease(release)

    def _make(self, generation: _Generation) -> list[AttributePatch]:
        made: dict[int, Callable[..., Any]] = {}

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            # The public alias is the same function: both names get the same wrapper.
            if id(original) in made:
                return made[id(original)]

            @functools.wraps(original)
            def _clip_grads_with_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
                if generation.live:
                    # A generator can be read once: read it here and hand the list on.
                    parameters = ([parameters] if isinstance(parameters, torch.Tensor)
                                  else list(parameters))
                    clipped = {id(p) for p in parameters}
                    for ref, mine in list(self._captures):
                        fn = ref()
                        if fn is not None and clipped & mine:
                            fn()
                return original(parameters, *args, **kwargs)

            made[id(original)] = _clip_grads_with_norm_
            return _clip_grads_with_norm_

        patches = [AttributePatch(clip_grad, CLIP_SCALE, wrap),
                   AttributePatch(torch.nn.utils, "clip_grads_with_norm_", wrap)]
        # DeepSpeed's engine clips with its own clip_grad_norm_ (ZeRO off), imported by name
        # into its module: measured before it too, when DeepSpeed is loaded (watch(engine, ...)).
        engine = sys.modules.get(DEEPSPEED_ENGINE)
        if engine is not None and callable(getattr(engine, "clip_grad_norm_", None)):
            patches.append(AttributePatch(engine, "clip_grad_norm_", wrap))
        return patches


class ZeroGradPatch(SharedPatch):
    """``module.zero_grad()`` runs the handler routed for that module, or for one it wraps, first.

    Loops and frameworks clear the gradients through the model as often as through the
    optimizer: the Hugging Face Trainer calls ``model.zero_grad()`` on the DDP wrapper accelerate
    built around the model it hands its callbacks, nanoGPT-style loops call it on the raw model.
    The class attribute is replaced, so a wrapper made after ``watch`` (and not known to the
    agent) is reached: a call is routed when the module, or a module it wraps (``.module`` of DDP,
    FSDP1 and DeepSpeed's engine, ``torch.compile``'s original), holds a route. Any other module
    takes torch's own path after a dictionary lookup per wrapper.
    """

    def __init__(self) -> None:
        super().__init__()
        self._routes: dict[int, tuple[Any, Any]] = {}

    def route(self, module: torch.nn.Module, handler: Callable[[], None]) -> Lease:
        """Call ``handler()`` before ``module.zero_grad()`` (or a wrapper's) until the lease is
        released.

        Args:
            module: a watched module (held weakly).
            handler: a bound method (held weakly).

        Returns:
            The lease; its release removes the route (and, the last one, the patch).
        """
        entry = (weakref.ref(module), _WeakBound(handler))
        key = id(module)
        with _lock:
            self._acquire()
            self._routes[key] = entry

        def release() -> None:
            with _lock:
                if self._routes.get(key) is entry:
                    del self._routes[key]
                self._release()

        return Lease(release)

    def handler_for(self, module: Any) -> Callable[[], None] | None:
        """The live handler routed for ``module`` or the first routed module inside it, or None."""
        for _ in range(MAX_WRAPPERS + 1):
            entry = self._routes.get(id(module))
            if entry is not None and entry[0]() is module:
                return entry[1]()
            module = wrapped_module(module)
            if module is None:
                return None
        return None

    def _make(self, generation: _Generation) -> list[AttributePatch]:
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def zero_grad(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                handler = self.handler_for(module) if generation.live and self._routes else None
                if handler is not None:
                    handler()
                return original(module, *args, **kwargs)
            return zero_grad

        return [AttributePatch(torch.nn.Module, "zero_grad", wrap)]


SCALER_STEP = ScalerStepPatch()
"""The process's ``GradScaler.step`` patch."""
CLIPPING = ClippingPatch()
"""The process's gradient clipping patch."""
ZERO_GRAD = ZeroGradPatch()
"""The process's ``Module.zero_grad`` patch."""


# ---------------------------------------------------------------- one agent's patches


class PatchSet:
    """The patches one agent installed, undone together by ``close()``.

    Holds the instance patches weakly (each lives as long as the object it patched) and the
    shared patches' leases, so nothing in it reaches the agent: ``close_when_collected`` can
    hand ``close`` to a finalizer.
    """

    def __init__(self) -> None:
        self._steps: list[weakref.ref[AttributePatch]] = []
        self._leases: list[Lease] = []
        self._finalizer: weakref.finalize | None = None
        self.closed = False

    def replace_step(self, optimizer: torch.optim.Optimizer,
                     step: Callable[..., Any]) -> AttributePatch:
        """Install ``step(closure=None)`` as ``optimizer.step`` (this instance only).

        Args:
            optimizer: the optimizer.
            step: called with the optimizer's ``step`` arguments; installed as a method bound
                to the optimizer, like the one it replaces (torch's LR schedulers unwrap
                ``step.__func__``), marked as one that tells them it stepped.

        Returns:
            The patch; the caller keeps it (the set holds it weakly), ``wrapped`` is the step
            it replaced.
        """
        def method(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return step(*args, **kwargs)

        mark_step_wrapped(method)
        patch = AttributePatch(optimizer, "step",
                               lambda _original: types.MethodType(method, optimizer))
        patch.install()
        self._steps.append(weakref.ref(patch))
        return patch

    def before_zero_grad(self, optimizer: Any, fn: Callable[[], None]) -> AttributePatch:
        """Call ``fn()`` before ``optimizer.zero_grad()`` clears the gradients (this instance).

        Args:
            optimizer: the optimizer (or any object with a ``zero_grad`` method).
            fn: a bound method (held weakly: once its object is gone, the call passes through).

        Returns:
            The patch (the set holds it weakly, the optimizer holds it as its ``zero_grad``).
        """
        ref = _WeakBound(fn)

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def zero_grad(opt: Any, *args: Any, **kwargs: Any) -> Any:
                before = ref()
                if before is not None:
                    before()
                return original(*args, **kwargs)
            return types.MethodType(zero_grad, optimizer)

        patch = AttributePatch(optimizer, "zero_grad", wrap)
        patch.install()
        self._steps.append(weakref.ref(patch))
        return patch

    def before_model_zero_grad(self, model: torch.nn.Module, fn: Callable[[], None]) -> None:
        """Call ``fn()`` before ``zero_grad()`` of ``model``, of a module inside it (DDP's
        ``.module``) or of a wrapper around it (see ``ZeroGradPatch``). A module whose class has
        a ``zero_grad`` of its own (DeepSpeed's engine sets the gradients to None itself) is
        patched on the instance as well.

        Args:
            model: the watched model.
            fn: a bound method (held weakly).
        """
        module: torch.nn.Module | None = model
        for _ in range(MAX_WRAPPERS + 1):
            if module is None:
                break
            self._leases.append(ZERO_GRAD.route(module, fn))
            if type(module).zero_grad is not torch.nn.Module.zero_grad:
                self.before_zero_grad(module, fn)
            module = wrapped_module(module)

    def route_scaler_step(self, optimizer: torch.optim.Optimizer,
                          handler: Callable[[Any], Any]) -> None:
        """Route ``GradScaler.step(optimizer)`` to ``handler(scaler)`` (see ``ScalerStepPatch``)."""
        self._leases.append(SCALER_STEP.route(optimizer, handler))

    def capture_clipping(self, fn: Callable[[], None], params: list[torch.Tensor]) -> None:
        """Call ``fn()`` before clipping scales ``params`` (see ``ClippingPatch``)."""
        self._leases.append(CLIPPING.capture(fn, params))

    def close_when_collected(self, owner: Any) -> None:
        """Run ``close()`` when ``owner`` is garbage-collected without it (the finalizer holds
        this set, never ``owner``)."""
        self._finalizer = weakref.finalize(owner, self.close)

    def close(self) -> None:
        """Undo every patch, the last installed first; idempotent."""
        with _lock:
            self.closed = True
            steps, self._steps = self._steps, []
            leases, self._leases = self._leases, []
            finalizer, self._finalizer = self._finalizer, None
        for lease in reversed(leases):
            lease.release()
        for ref in reversed(steps):
            patch = ref()
            if patch is not None:
                patch.uninstall()
        if finalizer is not None:
            finalizer.detach()
