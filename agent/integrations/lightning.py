"""torchvitals in Lightning: ``Trainer(callbacks=[torchvitals.LightningCallback(**config)])``.

Lightning calls ``optimizer.step(closure)``; the closure runs the training step, the backward,
``on_before_optimizer_step`` and Lightning's gradient clipping. The guard runs the closure, so
the step is measured (before the clipping: this callback captures the gradients in
``on_before_optimizer_step``), reduced and judged on every rank before the real step; the time
between batches is the data wait. Lightning's
scheduler, clipping, accumulation and checkpoints keep working; with ``16-mixed`` the plugin's
``scaler.step(optimizer)`` is routed through the agent too, so the steps the scaler skips for
an overflow are measured and reported. After a torchvitals rollback
``trainer.global_step`` still counts every ``optimizer.step()`` Lightning made (skipped and
rolled-back ones too); ``agent.step_count`` is the model's step.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl

from ...errors import TorchvitalsError
from ..agent import Agent, watch
from ..compat.pytorch import scaler_scale_async
from ..config import Config
from ..detect.verdict import Verdict
from ..report import Report


class LightningCallback(pl.Callback):
    """Watches the Trainer's model and optimizer on every rank.

    Args:
        **config: any ``torchvitals.Config`` field (``checkpoint_dir``, ``metrics_port``, ...);
            ``TORCHVITALS_*`` variables fill in the rest.
    """

    def __init__(self, **config: Any) -> None:
        Config.from_env(**config)  # a wrong setting fails at construction, not mid-fit
        self.config = config
        self.agent: Agent | None = None
        """The rank's agent while the framework trains (None before and after)."""
        self.last_report: Report | None = None
        """The last step's report, kept after training ends."""
        self.verdicts: list[Verdict] = []
        """Every verdict of the run, kept after training ends."""
        self._batch_end: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise TorchvitalsError(
                f"LightningCallback watches one optimizer; this module "
                f"configures {len(trainer.optimizers)}"
            )
        configs = trainer.lr_scheduler_configs
        scheduler = configs[0].scheduler if configs else None
        self.agent = watch(
            trainer.strategy.model or pl_module, trainer.optimizers[0], scheduler, **self.config
        )
        self.agent.scheduler_follows_step = (
            bool(configs) and configs[0].interval == "step" and configs[0].frequency == 1
        )
        # The training step's output passes through the module's forward; the loss is
        # recorded in on_before_backward instead (once, unnormalised).
        self.agent.loss_book.capture = False

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # From the last batch's end to this one's start: Lightning drew (and moved) the batch.
        if self.agent is not None and self._batch_end is not None:
            self.agent.record_data_wait(time.perf_counter() - self._batch_end)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._batch_end = time.perf_counter()

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any
    ) -> None:
        if self.agent is not None:
            # Lightning divides each micro-batch's loss by the accumulation before backward,
            # and with a GradScaler (16-mixed) this hook sees the scaled loss.
            loss = loss.detach() * trainer.accumulate_grad_batches
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if scaler is not None and scaler.is_enabled():
                loss = loss / scaler_scale_async(scaler)
            self.agent.record_loss(loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.agent is not None:
            self.agent.capture_gradients()  # before Lightning clips them

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close()

    def _close(self) -> None:
        if self.agent is not None:
            self.last_report = self.agent.last_report
            self.verdicts = list(self.agent.detector.history)
            self.agent.close()
            self.agent = None
