"""torchvitals in torchtitan: one line after the ``Trainer`` is built.

    trainer = config.build()                                     # torchtitan's train.py main()
    agent = torchvitals.watch_torchtitan(trainer, checkpoint_dir="/ckpt/torchvitals")
    trainer.train()

torchtitan's ``train_step`` clips the gradients and calls ``trainer.optimizers.step()`` then
``trainer.lr_schedulers.step()``; the guard takes the container's step (one agent step per
training step, the back-off applied to every optimizer inside it) and the clipping capture
measures the gradients before ``clip_grads_with_norm_`` scales them, so the report's total grad
norm is torchtitan's clip norm. What this adapter adds is what only the trainer knows:

- the loss: torchtitan's loss function returns the local token sum over the global token count
  (``global_valid_tokens``), and its logged loss is the SUM of those over the loss mesh and the
  micro-batches; each micro-batch's value is recorded as a share scaled by the loss mesh's size,
  so the agent's mean over the ranks is that same number;
- the step counter: after a rollback ``trainer.step`` is set to the restored step, so the run
  trains ``training.steps`` model steps and torchtitan's schedulers, its step counter and the
  restored state agree; a restart that resumes from a torchvitals checkpoint starts the trainer
  at that step;
- the non-finite check: a step torchvitals rolled back or skipped on every rank already had its
  NaN dealt with, so torchtitan's ``Loss is not finite ... Stopping training`` for that very
  step is absorbed (logged, not raised); any other non-finite loss still stops the run.

Checkpoint authority: both kinds of checkpoint carry the back-off. torchvitals' healthy
checkpoints (``checkpoint_dir``, with its ledger of back-offs and skipped batches) are the
rollback target and are resumed from at ``watch_torchtitan``. When torchtitan's own
``CheckpointManager`` is enabled, each checkpoint it writes also holds torchvitals' state (the
back-off, the skip list, the rollbacks the loop guard counts: ``torchtitan_checkpoint.py``), and
because ``trainer.step`` follows the rollback its step, scheduler and weights agree with it; a
restart from torchtitan's folder (``--checkpoint.enable``, the usual way) resumes with the
back-off. When both folders hold a checkpoint, the newer step wins (a tie: torchtitan's, which
also holds its data loader's position).

Pipeline parallelism with one stage per rank (``1F1B``, ``GPipe``) is watched like any run: each
rank watches its stage, the ranks agree on the union of their blocks (``measure/stages.py``),
the loss comes from the last stage's schedule, and the rollback and the checkpoints cover every
stage. Schedules with several stages per rank (interleaved, several model parts) are refused
with a clear error. The adapter patches two attributes of the trainer instance (``loss_fn``, or
under a pipeline its schedule's loss, and ``train_step``), and with torchtitan's checkpointer
enabled its ``load`` and one entry of its ``states``, and puts them back when the agent closes.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import TorchvitalsError
from ..agent import Agent, watch
from ..compat.pytorch import PIPELINE_LOSS
from ..patches import AttributePatch
from ..report import Action
from .torchtitan_checkpoint import TitanCheckpoints

log = logging.getLogger(__name__)

NONFINITE_MESSAGE = "Loss is not finite"
"""How torchtitan's ``train_step`` words the error it raises for a non-finite logged loss."""

ABSORBED_KEPT = 1000
"""Newest absorbed steps ``TorchtitanAdapter.absorbed`` keeps."""


class TorchtitanAdapter:
    """The trainer-side half of ``watch_torchtitan``: the loss, the step counter, the NaN check.

    Args:
        trainer: torchtitan's built ``Trainer``.
        agent: the agent watching its model part and optimizer container.
    """

    def __init__(self, trainer: Any, agent: Agent) -> None:
        self.trainer, self.agent = trainer, agent
        self.loss_scale = float(_loss_mesh_size(trainer))
        """What one rank's ``local sum / global tokens`` is multiplied by so the mean over the
        ranks is torchtitan's global loss (the loss mesh's size)."""
        self.absorbed: list[int] = []
        """The newest ``ABSORBED_KEPT`` steps whose non-finite loss check was absorbed (rolled
        back or skipped)."""
        # Under pipeline parallelism the last stage's schedule calls the loss function it was
        # built with, not the trainer's attribute: each microbatch's loss is taken there.
        schedule = getattr(trainer, "pp_schedule", None)
        self._patches = [
            AttributePatch(trainer, "loss_fn", lambda _: self.loss_fn)
            if schedule is None
            else AttributePatch(schedule, PIPELINE_LOSS, lambda _: self.loss_fn),
            AttributePatch(trainer, "train_step", lambda _: self.train_step),
        ]
        for patch in self._patches:
            patch.install()
        self._loss_fn, self._train_step = (p.wrapped for p in self._patches)
        self.checkpoints = (
            TitanCheckpoints(trainer, agent, self.resume_at)
            if getattr(getattr(trainer, "checkpointer", None), "enable", False)
            else None
        )
        """torchtitan's own checkpoints, carrying torchvitals' state (None: its checkpointer
        is off)."""
        if agent.resumed_from is not None:
            self._set_step(agent.resumed_from)

    def loss_fn(self, *args: Any, **kwargs: Any) -> Any:
        """torchtitan's loss function (or, under pipeline parallelism, the last stage's schedule's),
        recording each micro-batch's share of the step's loss."""
        out = self._loss_fn(*args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        self.agent.loss_book.record(loss * self.loss_scale, share=True)
        return out

    def train_step(self, data_iterator: Any) -> Any:
        """torchtitan's ``train_step``, then ``trainer.step`` set to the agent's model step."""
        before = self.agent.last_report
        try:
            return self._train_step(data_iterator)
        except RuntimeError as error:
            report = self.agent.last_report
            dealt = (
                report is not None
                and report is not before
                and report.action in (Action.ROLLBACK, Action.SKIP)
            )
            if report is None or not (dealt and NONFINITE_MESSAGE in str(error)):
                raise
            self.absorbed.append(report.step)
            if len(self.absorbed) > ABSORBED_KEPT:  # a run skipping NaN steps for days
                del self.absorbed[0]
            log.info(
                "torchvitals: step %d was %s by torchvitals; torchtitan's non-finite loss "
                "check for it is absorbed",
                report.step,
                "rolled back" if report.action == Action.ROLLBACK else "skipped",
            )
            return None
        finally:
            self._set_step(self.agent.step_count)

    def resume_at(self, step: int, load_seconds: float = 0.0) -> None:
        """The run continues after model step ``step`` (torchtitan's checkpoint was loaded, in
        ``load_seconds``): the agent's step count (and ``resumed_from``) and ``trainer.step``
        all at it."""
        self.agent.resume_at(step, load_seconds)
        self._set_step(step)

    def _set_step(self, step: int) -> None:
        """``trainer.step`` through the trainer's own train state (what its checkpoints save)."""
        state = self.trainer.state_dict()
        if state.get("step") != step:
            self.trainer.load_state_dict({**state, "step": step})

    def close(self) -> None:
        """Put the trainer's own ``loss_fn``, ``train_step`` and checkpointer back (if still
        ours); idempotent."""
        if self.checkpoints is not None:
            self.checkpoints.close()
        for patch in reversed(self._patches):
            patch.uninstall()


def watch_torchtitan(trainer: Any, **config: Any) -> Agent:
    """Watch a built torchtitan ``Trainer`` on this rank (call it on every rank).

    Args:
        trainer: torchtitan's ``Trainer`` after ``config.build()``, before ``trainer.train()``.
        **config: any ``torchvitals.Config`` field; ``TORCHVITALS_*`` variables fill in the rest.

    Returns:
        The Agent; ``agent.adapter`` is the ``TorchtitanAdapter``. ``agent.close()`` after
        training puts the trainer's attributes back.

    Raises:
        TorchvitalsError: the trainer has several model parts on this rank (an interleaved
            pipeline schedule).
    """
    parts = list(trainer.model_parts)
    if len(parts) != 1:
        raise TorchvitalsError(
            f"watch_torchtitan watches one pipeline stage per rank; this trainer has "
            f"{len(parts)} model parts on this rank (pipeline parallelism with an interleaved "
            f"schedule): use a schedule with one stage per rank "
            f"(parallelism.pipeline_parallel_schedule 1F1B or GPipe)"
        )
    agent = watch(parts[0], trainer.optimizers, trainer.lr_schedulers, **config)
    try:
        adapter = TorchtitanAdapter(trainer, agent)
    except BaseException:
        agent.close()
        raise
    agent.attach(adapter)
    return agent


def _loss_mesh_size(trainer: Any) -> int:
    """The size of the mesh torchtitan sums its logged loss over (1 without data parallelism)."""
    dims = trainer.parallel_dims
    if not getattr(dims, "dp_cp_enabled", False):
        return 1
    mesh = dims.get_optional_mesh("loss")
    return mesh.size() if mesh is not None else 1
