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
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from ..agent import Agent, watch
from ..config import Config
from ..detect.verdict import Verdict
from ..report import Report


class TransformersCallback(TrainerCallback):
    """Watches the Trainer's model and optimizer on every rank.

    Args:
        **config: any ``torchvitals.Config`` field; ``TORCHVITALS_*`` variables fill in the rest.
    """

    def __init__(self, **config: Any) -> None:
        Config.from_env(**config)
        self.config = config
        self.agent: Agent | None = None
        """The rank's agent while the framework trains (None before and after)."""
        self.last_report: Report | None = None
        """The last step's report, kept after training ends."""
        self.verdicts: list[Verdict] = []
        """Every verdict of the run, kept after training ends."""
        self._step_end: float | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)     # accelerate's wrapper
        self.agent = watch(model, inner, lr_scheduler, **self.config)
        if getattr(args, "average_tokens_across_devices", False):
            # The model then normalises each micro-batch by every rank's items, and the Trainer
            # multiplies the loss by the world size before backward: so do the recorded shares.
            self.agent.loss_book.share_scale = float(self.agent.world_size)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer draws every micro-batch of the step before its first forward.
        if self.agent is not None and self._step_end is not None:
            self.agent.record_data_wait(time.perf_counter() - self._step_end)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                          **kwargs: Any) -> None:
        # accelerate's fp16 path takes a step with no real optimizer step for an overflow skip,
        # and the Trainer then leaves its scheduler alone. After a rollback the restored
        # scheduler needs the step the Trainer gives it on every other path.
        report = self.agent.last_report if self.agent is not None else None
        if report is not None and report.action == "rollback" and \
                getattr(optimizer, "_is_overflow", False):
            optimizer._is_overflow = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_end = time.perf_counter()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.agent is not None:
            self.last_report = self.agent.last_report
            self.verdicts = list(self.agent.detector.history)
            self.agent.close()
            self.agent = None
