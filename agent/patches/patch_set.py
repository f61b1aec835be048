"""One agent's patches: its optimizer's ``step`` and ``zero_grad``, its leases of the shared ones.

    patches = PatchSet()
    patches.close_when_collected(agent)          # undone if the agent is dropped without close()
    patches.replace_step(optimizer, guard.guarded_step)          # optimizer.step (this instance)
    patches.before_model_zero_grad(model, agent._settle_skipped)  # Module.zero_grad (shared)
    patches.close()                              # the last installed undone first; idempotent

A ``PatchSet`` holds its instance patches weakly and nothing that reaches the agent, so
``close_when_collected`` can hand ``close`` to a finalizer. Each instance patch is held by its
replacement instead, which the patched object holds: the patch lives exactly as long as the
object carries it, so ``close()`` (from ``agent.close()``, a failed ``watch`` or the finalizer)
finds every one still on a live object, whether or not anyone else kept it.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..compat.pytorch import mark_step_wrapped
from ..compat.wrapped import wrapped_module
from .base import LOCK, AttributePatch, WeakBound
from .shared import CLIPPING, MAX_WRAPPERS, SCALER_STEP, ZERO_GRAD, Lease

HELD_AS = "_torchvitals_patch"
"""The attribute of an instance patch's replacement function that holds the patch."""


class PatchSet:
    """The patches one agent installed, undone together by ``close()``.

    Holds the instance patches weakly (each is held by its replacement, so it lives as long as
    the object it patched carries it) and the shared patches' leases, so nothing in it reaches
    the agent: ``close_when_collected`` can hand ``close`` to a finalizer.
    """

    def __init__(self) -> None:
        self._steps: list[weakref.ref[AttributePatch]] = []
        self._leases: list[Lease] = []
        self._finalizer: weakref.finalize | None = None
        self.closed = False

    def replace_step(
        self, optimizer: torch.optim.Optimizer, step: Callable[..., Any]
    ) -> AttributePatch:
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
        patch = AttributePatch(
            optimizer, "step", lambda _original: types.MethodType(method, optimizer)
        )
        self._install(patch)
        return patch

    def before_zero_grad(self, optimizer: Any, fn: Callable[[], None]) -> AttributePatch:
        """Call ``fn()`` before ``optimizer.zero_grad()`` clears the gradients (this instance).

        Args:
            optimizer: the optimizer (or any object with a ``zero_grad`` method).
            fn: a bound method (held weakly: once its object is gone, the call passes through).

        Returns:
            The patch (the set holds it weakly, the optimizer holds it through its
            ``zero_grad``).
        """
        ref = WeakBound(fn)

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def zero_grad(opt: Any, *args: Any, **kwargs: Any) -> Any:
                before = ref()
                if before is not None:
                    before()
                return original(*args, **kwargs)

            return types.MethodType(zero_grad, optimizer)

        patch = AttributePatch(optimizer, "zero_grad", wrap)
        self._install(patch)
        return patch

    def _install(self, patch: AttributePatch) -> None:
        """Install an instance patch and track it weakly. Its replacement, which the patched
        object holds, holds the patch: ``close()`` finds it for as long as the object carries it,
        however the agent ends, and no holder of it can reach the agent."""
        patch.install()
        setattr(patch.replacement.__func__, HELD_AS, patch)
        self._steps.append(weakref.ref(patch))

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

    def route_scaler_step(
        self, optimizer: torch.optim.Optimizer, handler: Callable[[Any], Any]
    ) -> None:
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
        with LOCK:
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
