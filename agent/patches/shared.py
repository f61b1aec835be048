"""The patches every agent in the process shares: installed by the first, put back by the last.

    lease = SCALER_STEP.route(optimizer, agent._scaler_step)   # GradScaler.step (the class)
    lease = ZERO_GRAD.route(module, agent._settle_skipped)      # Module.zero_grad (the class)
    lease = CLIPPING.capture(agent.capture_gradients, params)  # clip_grad's scaling (module)
    lease.release()                                            # idempotent

Each is a ``SharedPatch``: reference-counted leases, one installation (a generation) per first
lease, whose wrappers pass every call through once it is no longer live. A route holds its
object and its handler weakly, so a route whose agent is gone is inert: the call takes torch's
own path. Private torch names come from ``compat``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import TorchvitalsError
from ..compat.deepspeed import ENGINE_CLIP, loaded_engine_module
from ..compat.pytorch import CLIP_SCALE, GradScaler, clip_grad
from ..compat.wrapped import wrapped_module
from .base import LOCK, AttributePatch, WeakBound

MAX_WRAPPERS = 4
"""Module wrappers looked through from a ``zero_grad()`` call (accelerate's DDP around a
compiled model is two)."""


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
        with LOCK:
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
        with LOCK:
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
        with LOCK:
            release, self._release = self._release, None
        if release is not None:
            release()


class RoutedPatch(SharedPatch):
    """A shared patch whose calls on an object (an optimizer, a module) go to the handler routed
    for it: one route per object, the object and the handler both held weakly."""

    def __init__(self) -> None:
        super().__init__()
        self._routes: dict[int, tuple[weakref.ref[Any], WeakBound]] = {}

    def route(self, owner: Any, handler: Callable[..., Any]) -> Lease:
        """Send the patched call on ``owner`` to ``handler`` until the lease is released (each
        subclass says how it calls the handler).

        Args:
            owner: the watched optimizer or module (held weakly).
            handler: a bound method (held weakly).

        Returns:
            The lease; its release removes the route (and, the last one, the patch).
        """
        entry = (weakref.ref(owner), WeakBound(handler))
        key = id(owner)
        with LOCK:
            self._acquire()
            self._routes[key] = entry

        def release() -> None:
            with LOCK:
                if self._routes.get(key) is entry:
                    del self._routes[key]
                self._release()

        return Lease(release)

    def _route_of(self, owner: Any) -> WeakBound | None:
        """The weak handler routed for ``owner`` itself (not another object at its address)."""
        entry = self._routes.get(id(owner))
        return entry[1] if entry is not None and entry[0]() is owner else None


class ScalerStepPatch(RoutedPatch):
    """``GradScaler.step(optimizer)`` sent to the handler routed for that optimizer.

    ``scaler.step(optimizer)`` skips ``optimizer.step()`` altogether when it finds Inf/NaN
    gradients, so a loop or framework that steps through a GradScaler (nanoGPT's fp16 path,
    Lightning's ``16-mixed``, accelerate's fp16) would hide every overflow step from the agent.
    Routed (``route(optimizer, handler)``), every such call runs ``handler(scaler)``: the agent's
    step with that scaler. The class attribute is replaced (torch's CPU, CUDA and FSDP scalers
    inherit it), so a scaler made before or after ``watch`` is reached; other optimizers,
    disabled scalers and routes whose handler is gone keep the scaler's own step.
    """

    def handler_for(self, optimizer: Any) -> Callable[[Any], Any] | None:
        """The live handler routed for ``optimizer``, or None."""
        route = self._route_of(optimizer)
        return None if route is None else route()

    def _make(self, generation: _Generation) -> list[AttributePatch]:
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                handler = self.handler_for(optimizer) if generation.live else None
                if handler is None or not scaler.is_enabled():
                    return original(scaler, optimizer, *args, **kwargs)
                if "closure" in kwargs or any(a is not None for a in args):
                    raise TorchvitalsError(
                        "GradScaler.step(optimizer, closure) is not "
                        "supported: torch's GradScaler refuses closures too"
                    )
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
        entry = (WeakBound(fn), frozenset(id(p) for p in params))
        with LOCK:
            self._acquire()
            self._captures.append(entry)

        def release() -> None:
            with LOCK:
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
                    parameters = (
                        [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
                    )
                    clipped = {id(p) for p in parameters}
                    for ref, mine in list(self._captures):
                        fn = ref()
                        if fn is not None and clipped & mine:
                            fn()
                return original(parameters, *args, **kwargs)

            made[id(original)] = _clip_grads_with_norm_
            return _clip_grads_with_norm_

        patches = [
            AttributePatch(clip_grad, CLIP_SCALE, wrap),
            AttributePatch(torch.nn.utils, "clip_grads_with_norm_", wrap),
        ]
        # DeepSpeed's engine clips with its own clip_grad_norm_ (ZeRO off), imported by name
        # into its module: measured before it too, when DeepSpeed is loaded (watch(engine, ...)).
        engine = loaded_engine_module()
        if engine is not None:
            patches.append(AttributePatch(engine, ENGINE_CLIP, wrap))
        return patches


class ZeroGradPatch(RoutedPatch):
    """``module.zero_grad()`` runs the handler routed for that module, or for one it wraps, first.

    Loops and frameworks clear the gradients through the model as often as through the
    optimizer: the Hugging Face Trainer calls ``model.zero_grad()`` on the DDP wrapper accelerate
    built around the model it hands its callbacks, nanoGPT-style loops call it on the raw model.
    The class attribute is replaced, so a wrapper made after ``watch`` (and not known to the
    agent) is reached: a call is routed when the module, or a module it wraps (``.module`` of DDP,
    FSDP1 and DeepSpeed's engine, ``torch.compile``'s original), holds a route
    (``route(module, handler)``: ``handler()`` runs before torch's ``zero_grad``). Any other module
    takes torch's own path after a dictionary lookup per wrapper.
    """

    def handler_for(self, module: Any) -> Callable[[], None] | None:
        """The live handler routed for ``module`` or the first routed module inside it, or None."""
        for _ in range(MAX_WRAPPERS + 1):
            route = self._route_of(module)
            if route is not None:
                return route()
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
