"""Every attribute torchvitals replaces on someone else's object, installed and undone here.

    patches = PatchSet()
    patches.close_when_collected(agent)          # undone if the agent is dropped without close()
    patches.replace_step(optimizer, guard.guarded_step)         # optimizer.step (this instance)
    patches.before_zero_grad(optimizer, agent._settle_skipped)    # optimizer.zero_grad (instance)
    patches.before_model_zero_grad(model, agent._settle_skipped)  # Module.zero_grad (the class)
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

The package's modules, one scope each:

    base.py       the mechanics: ``AttributePatch`` (install, put back only what is still ours),
                  ``ForeignPatchWarning``, the lock, the weak reference a route holds
    shared.py     the process-wide patches, leased by every agent: ``GradScaler.step``
                  (``ScalerStepPatch``), gradient clipping (``ClippingPatch``), ``Module.zero_grad``
                  (``ZeroGradPatch``), and the process's one instance of each
    patch_set.py  one agent's patches (``PatchSet``): its optimizer's ``step`` and ``zero_grad``,
                  its leases of the shared ones, undone together

Private torch and framework names come from ``compat``.
"""

from .base import AttributePatch, ForeignPatchWarning
from .patch_set import PatchSet
from .shared import (
    CLIPPING,
    MAX_WRAPPERS,
    SCALER_STEP,
    ZERO_GRAD,
    ClippingPatch,
    Lease,
    RoutedPatch,
    ScalerStepPatch,
    SharedPatch,
    ZeroGradPatch,
)

__all__ = [
    "CLIPPING",
    "MAX_WRAPPERS",
    "SCALER_STEP",
    "ZERO_GRAD",
    "AttributePatch",
    "ClippingPatch",
    "ForeignPatchWarning",
    "Lease",
    "PatchSet",
    "RoutedPatch",
    "ScalerStepPatch",
    "SharedPatch",
    "ZeroGradPatch",
]
