"""torchvitals in the Hugging Face Trainer: ``Trainer(..., callbacks=[TransformersCallback()])``.

The Trainer (through accelerate) calls the torch optimizer's ``step()``, which the guard routes
through the agent; the loss comes from the model's output (``outputs.loss``), and the gradients
are measured when the Trainer calls ``torch.nn.utils.clip_grad_norm_``, before it clips; the time
between steps, when the Trainer draws the step's batches, is the data wait. The
Trainer's scheduler, ``max_grad_norm``, gradient accumulation and logging keep working. With
``fp16=True`` accelerate steps through its GradScaler: that ``scaler.step`` is routed through the
agent as well, so overflow steps are measured and reported, and the real step still goes through
accelerate's own wrapper (its scheduler steps only after a real step). After a
torchvitals rollback ``state.global_step`` still counts every optimizer step the Trainer made
(skipped and rolled-back ones too); ``agent.step_count`` is the model's step.

A ``train()`` that raises: the Trainer has no exception event (``on_train_end`` runs only after
a finished loop, and ``train()`` has no ``try``/``finally`` around its loop), so the callback
cannot close the agent then. It holds the agent weakly instead: what keeps the agent alive is the
Trainer's own model and optimizer (the guard and the hooks the agent installed on them), and the
process-wide patches route to it weakly (see ``agent/patches/``). So the agent, and every patch
it installed, goes with the failed Trainer: its finalizer puts ``GradScaler.step`` and the
clipping functions back once the Trainer is collected, even if this callback is kept (to read
``last_report``). Until then the patches act on that Trainer's optimizer and parameters only;
everything else takes torch's own path. A second ``train()`` on the same Trainer closes the
failed run's agent first. The alternatives were weaker: the Trainer does not expose its
accelerator or scaler to a callback before its first step, so no per-instance patch could
replace the process-wide ones, and ``sys.excepthook``-style tricks do not see an exception the
caller catches.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from transformers import TrainerCallback

from ..agent import Agent, watch
from ..compat.accelerate import accelerate_overflow, clear_accelerate_overflow
from ..config import Config
from ..detect.verdict import Verdict
from ..report import Action, Report


class TransformersCallback(TrainerCallback):
    """Watches the Trainer's model and optimizer on every rank.

    Args:
        **config: any ``torchvitals.Config`` field; ``TORCHVITALS_*`` variables fill in the rest.
    """

    def __init__(self, **config: Any) -> None:
        Config.from_env(**config)
        self.config = config
        self._agent: weakref.ref[Agent] | None = None
        self.last_report: Report | None = None
        """The last step's report, kept after training ends."""
        self.verdicts: list[Verdict] = []
        """Every verdict of the run, kept after training ends."""
        self._step_end: float | None = None

    @property
    def agent(self) -> Agent | None:
        """The rank's agent while the framework trains (None before and after); held weakly
        (the Trainer's model and optimizer keep it alive, see the module's docstring)."""
        return self._agent() if self._agent is not None else None

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        self._close()  # a train() that raised left its agent: done with it
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        agent = watch(model, inner, lr_scheduler, **self.config)
        self._agent = weakref.ref(agent)
        if getattr(args, "average_tokens_across_devices", False):
            # The model then normalises each micro-batch by every rank's items, and the Trainer
            # multiplies the loss by the world size before backward: so do the recorded shares.
            agent.loss_book.share_scale = float(agent.world_size)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer draws every micro-batch of the step before its first forward.
        agent = self.agent
        if agent is not None and self._step_end is not None:
            agent.record_data_wait(time.perf_counter() - self._step_end)

    def on_optimizer_step(
        self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any
    ) -> None:
        # accelerate's fp16 path takes a step with no real optimizer step for an overflow skip,
        # and the Trainer then leaves its scheduler alone. After a rollback the restored
        # scheduler needs the step the Trainer gives it on every other path.
        agent = self.agent
        report = agent.last_report if agent is not None else None
        if (
            report is not None
            and report.action == Action.ROLLBACK
            and accelerate_overflow(optimizer)
        ):
            clear_accelerate_overflow(optimizer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_end = time.perf_counter()
        agent = self.agent
        if agent is not None:  # kept if train() raises and the agent goes with it
            self.last_report = agent.last_report

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        agent, self._agent = self.agent, None
        if agent is not None:
            self.last_report = agent.last_report
            self.verdicts = list(agent.detector.history)
            agent.close()
