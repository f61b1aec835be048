"""Wiring checks: frozen parameters, parameters no optimizer steps, train-mode modules in eval.

from torchvitals.agent.detect.wiring import wiring_checks
for finding in wiring_checks(model, optimizer, evaluate=run_validation):
    print(finding)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compat.pytorch import BatchNorm, DropoutNd
from .verdict import CRITICAL, DEAD_LAYER, INFO, WARNING, Verdict


@dataclass(frozen=True)
class Finding:
    """One wiring problem: which check, on what, why it matters, how bad (detect severities)."""

    check: str
    subject: str
    message: str
    severity: str


def wiring_checks(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    evaluate: Callable[[nn.Module], Any] | None = None,
) -> list[Finding]:
    """Frozen parameters, parameters the optimizer misses, and train-mode modules in evaluation.

    Args:
        model: the model as it will be trained.
        optimizer: the optimizer that will train it (None skips that check).
        evaluate: ``evaluate(model)`` runs the user's evaluation; it is run once, then the
            model's train/eval flags and BatchNorm buffers are restored.

    Returns:
        The findings, empty on a correct setup.
    """
    frozen, missing = unstepped(list(model.named_parameters()), optimizer)
    findings = [
        Finding(
            "frozen_parameters",
            m,
            f"{', '.join(ps)} have requires_grad=False: "
            "intended (fine-tuning) or forgotten after a freeze?",
            WARNING,
        )
        for m, ps in _by_module(frozen).items()
    ]
    if optimizer is not None:
        findings += [
            Finding(
                "not_in_optimizer",
                m,
                f"{', '.join(ps)} are trainable but in no optimizer "
                "param group: they get gradients and never move",
                CRITICAL,
            )
            for m, ps in _by_module(missing).items()
        ]
    if evaluate is not None:
        findings += _evaluation_findings(model, evaluate)
    return findings


def _evaluation_findings(model: nn.Module, evaluate: Callable[[nn.Module], Any]) -> list[Finding]:
    watched = {n: m for n, m in model.named_modules() if isinstance(m, (DropoutNd, BatchNorm))}
    in_train, grad_on = set(), []
    handles = [
        m.register_forward_pre_hook(lambda mod, _, n=n: in_train.add(n) if mod.training else None)
        for n, m in watched.items()
    ]
    handles.append(
        model.register_forward_pre_hook(lambda *_: grad_on.append(torch.is_grad_enabled()))
    )
    modes = {m: m.training for m in model.modules()}
    buffers = {n: [b.detach().clone() for b in m.buffers()] for n, m in watched.items()}
    try:
        evaluate(model)
    finally:
        for h in handles:
            h.remove()
        left_eval = any(m.training != was for m, was in modes.items())
        with torch.no_grad():  # undo what a train-mode evaluation did to the running stats
            for n, saved in buffers.items():
                for b, s in zip(watched[n].buffers(), saved):
                    b.copy_(s)
        for m, was in modes.items():
            m.training = was
    dropout = ", ".join(sorted(n for n in in_train if isinstance(watched[n], DropoutNd)))
    norms = ", ".join(sorted(n for n in in_train if isinstance(watched[n], BatchNorm)))
    candidates = [
        (
            dropout,
            Finding(
                "dropout_active_in_eval",
                dropout,
                "dropout ran in training mode during "
                "evaluate(): call model.eval() before evaluating",
                CRITICAL,
            ),
        ),
        (
            norms,
            Finding(
                "batchnorm_train_in_eval",
                norms,
                "BatchNorm used batch statistics and updated "
                "its running stats during evaluate(): call model.eval()",
                CRITICAL,
            ),
        ),
        (
            any(grad_on),
            Finding(
                "grad_enabled_in_eval",
                "evaluate",
                "autograd was on during evaluation: "
                "wrap it in torch.no_grad() to save memory and time",
                INFO,
            ),
        ),
        (
            left_eval and not (dropout or norms),
            Finding(
                "left_in_eval",
                "evaluate",
                "evaluate() changed the model's train/eval mode without "
                "restoring it: call model.train() before training resumes",
                WARNING,
            ),
        ),
    ]
    return [f for hit, f in candidates if hit]


def _by_module(names: Iterable[str]) -> dict[str, list[str]]:
    """Parameter names grouped by owning module, so a frozen backbone is one line per module."""
    groups: dict[str, list[str]] = {}
    for n in names:
        module, _, leaf = n.rpartition(".")
        groups.setdefault(module or "(root)", []).append(leaf)
    return groups


def unstepped(named: list[tuple[str, nn.Parameter]], optimizer: Any) -> tuple[list[str], list[str]]:
    """The names of the parameters that never move: frozen ones (``requires_grad=False``), and
    trainable ones in no param group of ``optimizer`` (none when ``optimizer`` is None)."""
    held = (
        None
        if optimizer is None
        else {id(p) for group in optimizer.param_groups for p in group["params"]}
    )
    frozen = [n for n, p in named if not p.requires_grad]
    missing = [] if held is None else [n for n, p in named if p.requires_grad and id(p) not in held]
    return frozen, missing


def wiring_verdicts(blocks: Any, optimizer: Any) -> list[Verdict]:
    """dead_layer verdicts known before any step: frozen parameters, or ones no optimizer steps."""
    found = []
    for name, params in zip(blocks.names, blocks.params):
        frozen, missing = unstepped(params, optimizer)
        if frozen or missing:
            found.append(
                Verdict(
                    DEAD_LAYER,
                    WARNING,
                    0,
                    name,
                    {
                        "requires_grad_false": frozen[:10],
                        "not_in_optimizer": missing[:10],
                        "parameters": len(params),
                        "fired": "wiring",
                    },
                )
            )
    return found
