"""The guarded optimizer: whoever calls ``optimizer.step()``, the step goes through the agent.

    agent = torchvitals.watch(model, optimizer)     # installs the guard
    loss.backward()
    optimizer.step()        # measured, reduced, judged; then stepped, skipped or rolled back

Frameworks (Lightning, the Hugging Face Trainer, torchtitan) and nanoGPT-style scripts call
``optimizer.step()`` themselves; the guard replaces the optimizer instance's ``step`` with one
that runs the agent's pipeline and calls the real step only when every rank agreed to step.
Three more things happen here because only the step knows them:

- the learning rate: the watchdog's back-off multiplies each group's ``lr`` for the duration of
  the real step and puts the value back, so whatever sets ``lr`` (a scheduler, a framework, a
  line of user code) sets the intended rate and the back-off still applies;
- a second ``optimizer.step()`` with no backward pass since the last one (the same gradients
  applied twice: a callback stepping as well as the framework) is flagged to the step, and
  every rank raises ``DoubleStepError`` together (``double_step_error``);
- a real step that did not come through the guard (a bound ``step`` taken before ``watch``)
  raises ``GuardBypassedError`` from the optimizer's own pre-step hook, before it changes
  anything.

The guard is installed through ``patches.PatchSet.replace_step``, which puts the optimizer's own
``step`` back at ``close()`` unless someone wrapped the guard since: that wrapper then stays, and
the closed guard passes its calls straight to the real step. The ``GradScaler.step`` route and
the clipping capture live in ``patches`` as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import TorchvitalsError
from .backends.optimizers import Optimizers, resolve
from .compat.pytorch import mark_optimizer_stepped, tensor_version
from .patches import PatchSet

T = TypeVar("T")
R = TypeVar("R")


class DoubleStepError(TorchvitalsError, RuntimeError):
    """``optimizer.step()`` ran twice on the same gradients."""


class GuardBypassedError(TorchvitalsError, RuntimeError):
    """The optimizer stepped without going through torchvitals."""


class StepGuard:
    """Installs itself as ``optimizer.step`` and routes every call to ``run``.

    Args:
        optimizer: the torch optimizer, or a container of them (``optimizers.resolve``): the
            container's own ``step`` is guarded, the optimizers inside it hold the LRs.
        run: ``run(closure_loss, repeated)`` runs the agent's step (it calls ``real_step`` to
            step; ``repeated``: see ``checked``).
        watched: the parameters whose gradients tell one backward pass from the next.
        patches: the agent's patches; the guard installs itself as ``optimizer.step`` there.
        stepper: the object whose ``step`` is replaced, when not ``optimizer`` (DeepSpeed's ZeRO
            optimizer, which steps ``optimizer`` once per param group: see ``backends``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Optimizers,
        run: Callable[[Any, bool], Any],
        watched: list[torch.Tensor],
        patches: PatchSet,
        stepper: Any = None,
    ) -> None:
        self.optimizers = resolve(optimizer)
        optimizer = self.optimizers.stepped
        if any(isinstance(o, torch.optim.LBFGS) for o in self.optimizers.torch_optimizers):
            raise TorchvitalsError(
                "torchvitals cannot guard LBFGS: it re-evaluates its closure "
                "many times per step, and the agent measures one gradient"
            )
        self.optimizer, self._run = optimizer, run
        self._inside = False
        self.closed = False
        self._marks: list[tuple[torch.Tensor, int]] = []
        # A few of the smallest parameters: their gradients are cheap to keep a reference to,
        # and any backward pass that reaches the model replaces or bumps at least one of them.
        self._probes = sorted(watched, key=lambda p: p.numel())[:4]
        # A bound method, like the one it replaces: torch's LR schedulers wrap ``step.__func__``,
        # and skip (and do not warn) when it says it tells them it stepped, which real_step does.
        self._stepper = optimizer if stepper is None else stepper
        self._patch = patches.replace_step(self._stepper, self.guarded_step)
        self._original = self._patch.wrapped  # e.g. an LR scheduler's wrapper
        # A container that is not a torch Optimizer has no step hooks: nothing to bypass there.
        register = getattr(optimizer, "register_step_pre_hook", None)
        self._hook = register(self._pre_hook) if register is not None else None

    def guarded_step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """What ``optimizer.step()`` now does: the agent's step (and, inside it, the real one)."""
        if self._inside or self.closed:
            # real_step called the optimizer's current ``step``, a wrapper someone put around
            # this one (a framework's "it stepped" marker): this is the real step. Closed, a
            # wrapper that outlived the guard still steps.
            return self._original(closure) if closure is not None else self._original()
        if kwargs:
            raise TorchvitalsError(
                f"torchvitals' guarded step takes only a closure, got {sorted(kwargs)}"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.checked(lambda repeated: self._run(loss, repeated))
        return loss

    def checked(self, run: Callable[[bool], R]) -> R:
        """``run(repeated)`` as one step, whichever door it came through: ``repeated`` says no
        backward pass ran on this rank since its last step (the same gradients twice). The
        step packs it with its other flags, and every rank raises ``DoubleStepError`` together
        when any rank's is set (``double_step_error``)."""
        repeated = bool(self._mark()) and not self.has_new_gradients()
        try:
            return run(repeated)
        finally:
            # Marked after the step: unscaling and clipping change the gradients in place.
            self._marks = self._mark()

    def real_step(self, lr_scale: float, through_attribute: bool = False) -> None:
        """Step the wrapped optimizer once with each group's ``lr`` multiplied by ``lr_scale``.

        ``through_attribute``: call the optimizer's current ``step``, as ``GradScaler.step``
        does (the step came from a scaler): a wrapper a framework installs for the length of its
        step sees it (accelerate marks that the optimizer really stepped, and steps its
        scheduler only then); a wrapper around the guard lands back in ``guarded_step``, which
        takes the real step. Otherwise the caller's ``optimizer.step()`` already went through
        any such wrapper, and the original step is called.
        """
        groups = self.optimizers.param_groups
        intended = [g["lr"] for g in groups]
        try:
            if lr_scale != 1.0:
                for g, lr in zip(groups, intended):
                    g["lr"] = lr * lr_scale
            self._inside = True
            for inner in self.optimizers.torch_optimizers:
                mark_optimizer_stepped(inner)
            if through_attribute:
                self._stepper.step()
            else:
                self._original()
        finally:
            self._inside = False
            for g, lr in zip(groups, intended):
                g["lr"] = lr

    def effective_lr(self, lr_scale: float) -> list[float]:
        """The learning rate of each param group as a step would apply it now."""
        return [_host_float(g["lr"]) * lr_scale for g in self.optimizers.param_groups]

    def probe_grads(self) -> list[Any]:
        """The probe parameters' gradient tensors: a backward pass after ``zero_grad()`` makes
        new ones, so holding these tells whether gradients are still the same step's."""
        return [p.grad for p in self._probes]

    def _mark(self) -> list[tuple[torch.Tensor, int]]:
        return [(g, tensor_version(g)) for g in (p.grad for p in self._probes) if g is not None]

    def has_new_gradients(self) -> bool:
        """A backward pass reached the model since the last step (its probes' gradients are
        new tensors, or were changed in place)."""
        marks = self._mark()
        return bool(marks) and not (
            self._marks
            and len(marks) == len(self._marks)
            and all(
                new is old and version == seen
                for (new, version), (old, seen) in zip(marks, self._marks)
            )
        )

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._inside:
            raise GuardBypassedError(
                "the optimizer stepped without torchvitals: its step() was called through a "
                "reference taken before torchvitals.watch() (or the class method directly), so "
                "no rank measured or agreed on this step. Call optimizer.step() after watch()"
            )

    def close(self) -> None:
        """Give the optimizer its own ``step`` back (unless a wrapper was put around the guard
        since: it stays, and reaches the real step); idempotent."""
        self.closed = True
        if self._hook is not None:
            self._hook.remove()
        self._patch.uninstall()


def double_step_error(count: int, ranks: list[int], world_size: int) -> DoubleStepError:
    """The error every rank raises when ``count`` ranks (``ranks``, when named) stepped twice on
    the same gradients; nothing of the step was applied."""
    where = (
        ""
        if world_size == 1
        else f" on rank{'s' * (count > 1)} {', '.join(map(str, ranks))}"
        if ranks
        else f" on {count} ranks"
    )
    return DoubleStepError(
        f"optimizer.step() was called again with no backward pass since the last step{where}: "
        "the same gradients would be applied twice, so no rank steps and every rank stops "
        "here. With torchvitals.watch() the optimizer's own step() already runs the agent: call "
        "either agent.step(loss) or optimizer.step(), once per training step (a framework "
        "callback must not step)"
    )


def same_tensors(a: list[Any], b: list[Any]) -> bool:
    """The same tensor objects (identity, not values), in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _host_float(lr: Any) -> float:
    """A group's ``lr`` as a float, without a device sync (a CUDA tensor LR reads as NaN)."""
    if isinstance(lr, torch.Tensor):
        return float(lr) if lr.device.type == "cpu" else float("nan")
    return float(lr)


# ---------------------------------------------------------------- gradient clipping


class ClipWatch:
    """Warns once when the measured total gradient norm sits at one value step after step: the
    loop clipped before the agent measured, so the norms are the clipped ones."""

    def __init__(self, steps: int = 5, log: Any = None) -> None:
        self.steps, self._log = steps, log
        self._value, self._run, self.warned = float("nan"), 0, False

    def observe(self, report: Any) -> None:
        total = report.grad_norm_total
        same = total > 0 and abs(total - self._value) <= 1e-6 * total
        self._run = self._run + 1 if same else 0
        self._value = total
        if self._run + 1 >= self.steps and not self.warned and self._log is not None:
            self.warned = True
            self._log.warning(
                "torchvitals: the total gradient norm has been %.6g for %d steps: the gradients "
                "look clipped before torchvitals measured them, so the reported norms are the "
                "clipped ones. Clip with torch.nn.utils.clip_grad_norm_ (or "
                "clip_grads_with_norm_), which torchvitals measures before, or let torchvitals "
                "clip: watch(..., clip_grad_norm=%.6g)",
                total,
                self.steps,
                total,
            )
