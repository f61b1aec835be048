"""GradScaler (fp16) support: measure true-scale gradients and keep every rank's scaler in step.

The agent unscales before measuring, so norms are the real ones; an overflow on any rank (the
reduced non-finite flag) makes every rank's scaler see an overflow, so all skip the step and back
the scale off together instead of diverging. The scaler reaches the step either from
``agent.step(loss, scaler=...)`` (the agent also updates it) or through the loop's or the
framework's own ``scaler.step(optimizer)``, which the guard routes here (the caller updates it).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat.pytorch import scaler_found_inf, scaler_scale_async, scaler_stage_unscaled


def enabled(scaler: Any) -> bool:
    return scaler is not None and scaler.is_enabled()


def unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Unscale the gradients in place, unless the loop already did (to clip them); return the
    scale used, as a device tensor (no sync)."""
    if not scaler_stage_unscaled(scaler, optimizer):
        scaler.unscale_(optimizer)
    # GradScaler's own no-sync accessor (get_scale() calls .item()).
    return scaler_scale_async(scaler).detach().reshape(())


def finish(scaler: Any, optimizer: torch.optim.Optimizer, overflow: bool, update: bool) -> None:
    """Record the job-wide overflow verdict in this rank's scaler; update its scale unless the
    caller does (``scaler.step`` then ``scaler.update()`` in the loop or the framework)."""
    if overflow:
        for found_inf in scaler_found_inf(scaler, optimizer):
            found_inf.fill_(1.0)
    if update:
        scaler.update()
