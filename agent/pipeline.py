"""What one training step does, once the guarded ``optimizer.step()`` hands it over.

    measure -> reduce -> detect -> recover -> outputs

``StepPipeline`` is the half of the ``Agent`` that runs each step: it packs this rank's
statistics (``measure/``), reduces them with every rank in one packed collective, unpacks the
identical Report, lets the detector name what it sees (``detect/``), lets the watchdog step,
skip, checkpoint or roll back (``recover/``), and hands the report to the sinks (``outputs/``).
``agent.py`` holds the other half: the wiring at ``watch()`` and the public API. Every rank
runs the same code on the same reduced numbers, so every rank takes the same action.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import torch
from torch import nn

from ..protocol import ABORTED, CODES
from .detect.verdict import COLLECTOR_DIRECTIVE, CRITICAL, ROLLBACK_LOOP, Verdict
from .guard import same_tensors
from .measure import scaler as amp
from .measure.loss import LossBook
from .measure.reduce import Packer, unpack
from .measure.stats import local
from .recover.watchdog import TrainingAborted
from .report import Report

log = logging.getLogger("torchvitals.agent.agent")


class StepPipeline:
    """The per-step methods of ``Agent`` (see ``agent.py`` for the attributes they use)."""

    def _arm(self) -> None:
        if self._acts is not None:
            self._acts.arm()
            self._attn.arm()

    def _on_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._forward_end = self._clock()

    def _run_step(self, closure_loss: Any) -> Report:
        """The whole step, from the guarded ``optimizer.step()``: measure, reduce, decide, act."""
        if self._aborted is not None:
            raise self._aborted      # a loop that swallowed the abort must not train on
        call = self._call or {}
        loss = self.loss_book.take(call.get("loss"), closure_loss)
        scaler, owns_scheduler = call.get("scaler"), self._call is not None
        update_scaler = scaler is not None          # agent.step(scaler=): the agent updates it
        if scaler is None:
            scaler = self._loop_scaler              # scaler.step(optimizer): the caller updates
        step = self.step_count + 1
        step_seconds = self._clock() - self._last_end
        use_scaler = amp.enabled(scaler)
        pending, self._pending_update = self._pending_update, None
        packer, compute = self._measure(loss, step_seconds, scaler if use_scaler else None, pending)
        layout, host = self._reducer.reduce(packer)
        report = unpack(layout, host, step=step, names=self.blocks.names,
                        world_size=self.world_size, rank=self.rank, pending=pending)
        report.step_seconds, report.samples = step_seconds, call.get("samples")
        report.tokens, report.compute_seconds = call.get("tokens"), compute
        report.lr = self._guard.effective_lr(self.lr_scale)
        self._clip_check.observe(report)
        vitals = self._vitals.unpack(layout, host, report)
        self._timing.observe(compute, report.mean_compute_seconds * self.world_size,
                             report.local_data_wait_seconds)
        if self.watchdog is not None:
            self.watchdog.settle(layout.get(host, "checkpoint"), self.world_size, report)
        extra: dict[str, Any] = {"straggler": layout.get(host, "straggler"), **vitals}
        if use_scaler:
            report.loss_scale = layout.get(host, "loss_scale")[0]
            report.overflow = report.nonfinite_grad and not report.nonfinite_loss
            extra["scaler"] = {"scale": report.loss_scale, "overflow": report.overflow}
        report.verdicts = self.detector.observe(report, extra)
        if self.config.collector_url:
            self._directive(report, layout.get(host, "directive")[0])
        self._losses.append((step, report.loss))
        self._ticks += 1
        critical = sorted({v.pattern for v in report.verdicts if v.severity == CRITICAL})
        if self.watchdog is not None:
            self.watchdog.note(step, report.verdicts)
        if critical and self.watchdog is not None:
            self._rollback(report, ", ".join(critical))
        elif report.nonfinite and (self.config.skip_nonfinite or report.overflow):
            report.action = "skip"
        else:
            self._optimizer_step(report, self.sampled(step + 1), owns_scheduler)
            if self.watchdog is not None:
                report.checkpointed = self.watchdog.maybe_save(
                    step, self.model, self.optimizer, self.scheduler, self.detector,
                    scheduler_step_due=not owns_scheduler and self.scheduler_follows_step)
                if report.checkpointed:
                    self._detector_at[step] = self.detector.snapshot()  # kept: committed + new
                    self._detector_at = {s: d for s, d in self._detector_at.items()
                                         if s in (step, self.watchdog.last_healthy)}
        if use_scaler:
            amp.finish(scaler, self.optimizer, overflow=report.action != "step",
                       update=update_scaler)
        self.step_count = report.rollback["to_step"] if report.rollback else step
        if self.sampled(self.step_count + 1):
            self._arm()
        self._publish(report)
        if self.heartbeat is not None:
            self.heartbeat.beat(self._ticks)
        self.last_report = report
        self._last_end = self._clock()
        return report

    def _scaler_step(self, scaler: Any) -> Any:
        """``scaler.step(optimizer)`` from the loop or a framework (see guard.intercept_scaler_step)."""
        self._loop_scaler = scaler
        try:
            return self._guard.guarded_step()
        finally:
            self._loop_scaler = None

    def _rollback(self, report: Report, reason: str) -> None:
        """Every rank, same step: back to the last healthy checkpoint, or skip without one."""
        try:
            rolled = self.watchdog.rollback(report.step, self._ticks, reason, self.model,
                                            self.optimizer, self.scheduler)
        except TrainingAborted as aborted:
            self._abort(report, aborted, Verdict(ROLLBACK_LOOP, CRITICAL, report.step, None, {
                "reason": reason, "max_rollbacks": self.config.max_rollbacks,
                "rollback_window": self.config.rollback_window,
                "exit_code": self.config.abort_exit_code}))
        if rolled is None:
            report.action = "skip"
            return
        report.action, report.rollback = "rollback", rolled.to_dict()
        self._pending_update = None
        if rolled.to_step in self._detector_at:
            self.detector.restore(self._detector_at[rolled.to_step])

    def _directive(self, report: Report, code: float) -> None:
        """Every rank, same step: a collector's directive becomes a critical verdict, or an abort."""
        action = CODES.get(code)
        if action is None:
            return
        taken = self._poller.take() if self._poller is not None else None
        if taken is not None:
            log.warning("torchvitals: collector directive %s (%s) at step %d", taken["id"], action,
                        report.step)
        verdict = Verdict(COLLECTOR_DIRECTIVE, CRITICAL, report.step, None, {"action": action})
        if action == "abort":
            if self.rank == 0:
                log.error("torchvitals: ABORTING at step %d: the collector ordered it (%s). "
                          "Exit code %d.", report.step, self.config.collector_url,
                          self.config.abort_exit_code)
            self._abort(report, TrainingAborted(self.config.abort_exit_code), verdict)
        report.verdicts.append(verdict)
        self.detector.history.append(verdict)

    def _abort(self, report: Report, aborted: TrainingAborted, verdict: Verdict) -> NoReturn:
        """Publish the abort, tell the supervisor it is on purpose (torchrun turns every worker
        failure into exit status 1, so the exit code alone cannot say it), and raise."""
        self._aborted = aborted
        report.verdicts.append(verdict)
        self.detector.history.append(verdict)
        report.action = "abort"
        self._publish(report)
        if self.heartbeat is not None:
            self.heartbeat.beat(self._ticks, phase=ABORTED)
        raise aborted

    def _publish(self, report: Report) -> None:
        recovery = self.watchdog.metrics() if self.watchdog is not None else None
        self._out.publish(report, self.detector, recovery)

    def _measure(self, loss: torch.Tensor | float | None, step_seconds: float, scaler: Any,
                 pending: tuple[Any, ...] | None) -> tuple[Packer, float]:
        """This rank's statistics of the step packed for the reduction, and its compute time."""
        compute = (self._forward_end - self._last_end if self._forward_end > self._last_end
                   else step_seconds)
        packer = Packer(self.device)
        packer.add_host_sum("checkpoint", self.watchdog.save_flags() if self.watchdog else [0.0, 0.0])
        # O(1) in the world size: sums, and a straggler's own flag (see detect/straggler.py).
        packer.add_host_sum("rank_seconds", [step_seconds, compute])
        packer.add_host_sum("straggler", self._timing.flags())
        self._vitals.pack(packer, step_seconds, sampled=self.sampled(self.step_count + 1))
        if scaler is not None:
            packer.add_sum("loss_scale", amp.unscale(scaler, self.optimizer) / self.world_size)
        captured, self._captured = self._captured, None
        if captured is not None and not same_tensors(self._guard.probe_grads(), self._captured_from):
            captured = None           # measured before a step the loop then left out
        self._captured_from = []
        packer.add_sum("grad_sq", captured if captured is not None else self._grads.block_sq(self.device))
        LossBook.pack(packer, loss, self.device)
        if self.config.collector_url:
            # Only rank 0 polls, so the SUM carries its code to every rank unchanged.
            packer.add_host_sum("directive", [self._poller.code() if self._poller else 0.0])
        if pending is not None:
            packer.add_sum("update_dsq", pending[0])
            packer.add_sum("update_wsq", pending[1])
        if self._acts is not None and self._acts.armed:
            counts, sums, maxes = self._acts.take(self.device)
            packer.add_host_sum("act_count", counts)
            packer.add_sum("act_sums", sums)
            packer.add_max("act_max", maxes)
            counts, neg_entropy, logit = self._attn.take(self.device)
            packer.add_host_sum("attn_count", counts)
            packer.add_max("attn_neg_entropy", neg_entropy)
            packer.add_max("attn_logit", logit)
        return packer, compute

    def _optimizer_step(self, report: Report, measure: bool, owns_scheduler: bool) -> None:
        """The real optimizer step (LR backed off), the scheduler's when the agent owns it."""
        clip = self.config.clip_grad_norm
        if clip is not None and report.grad_norm_total > clip:
            report.clip_coef = clip / (report.grad_norm_total + 1e-6)
            grads = [local(p.grad) for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, report.clip_coef)
        measure = measure and self._update is not None
        if measure:
            self._update.before_step()
        self._guard.real_step(self.lr_scale, through_attribute=self._loop_scaler is not None)
        if owns_scheduler and self.scheduler is not None:
            self.scheduler.step()
        if measure:
            d_sq, w_sq, chosen = self._update.after_step(self.device)
            self._pending_update = (d_sq, w_sq, chosen, report.step)
