"""Independent references for the exactness tests, in plain float64 torch ops.

    from support.reference import ref_grad_norms, ref_update_ratios, OutputRecorder

The references use plain float64 torch ops on full tensors, never the agent's code paths.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def block_of(name: str, prefixes: list[str]) -> str:
    best = ""
    for p in prefixes:
        if (name == p or name.startswith(p + ".")) and len(p) > len(best):
            best = p
    return best or "other"


def full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a DTensor (all-gathered) or a plain one."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def ref_grad_norms(model: nn.Module, prefixes: list[str]) -> tuple[dict[str, float], float]:
    """Per-block gradient L2 norms in float64, and clip_grad_norm_'s total."""
    sq: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = full(p.grad).detach().double()
        b = block_of(name.removeprefix("module."), prefixes)
        sq[b] = sq.get(b, 0.0) + float((g * g).sum())
    grads = [p for p in model.parameters() if p.grad is not None]
    total = float(full(torch.nn.utils.clip_grad_norm_(grads, float("inf"))))
    return {b: math.sqrt(v) for b, v in sq.items()}, total


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n.removeprefix("module."): full(p.detach()).double().clone()
        for n, p in model.named_parameters()
    }


def ref_update_ratios(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], prefixes: list[str]
) -> dict[str, float]:
    d_sq: dict[str, float] = {}
    w_sq: dict[str, float] = {}
    for name, w0 in before.items():
        b = block_of(name, prefixes)
        d_sq[b] = d_sq.get(b, 0.0) + float(((after[name] - w0) ** 2).sum())
        w_sq[b] = w_sq.get(b, 0.0) + float((w0**2).sum())
    return {b: math.sqrt(d_sq[b]) / math.sqrt(w_sq[b]) for b in d_sq}


class OutputRecorder:
    """Forward hooks that keep each named module's outputs (float64 copies)."""

    def __init__(self, model: nn.Module, paths: list[str]):
        modules = dict(model.named_modules())
        self.outputs: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
        self.handles = [modules[p].register_forward_hook(self._hook(p)) for p in paths]

    def _hook(self, path: str):
        def hook(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self.outputs[path].append(out.detach().double().clone())

        return hook

    def stats(self, saturation_level: float = 0.99) -> dict[str, dict[str, float]]:
        result = {}
        for path, outs in self.outputs.items():
            x = torch.cat([o.reshape(-1) for o in outs])
            result[path] = {
                "mean": float(x.mean()),
                "rms": float(x.pow(2).mean().sqrt()),
                "abs_max": float(x.abs().max()),
                "zero_fraction": float((x == 0).double().mean()),
                "saturation_fraction": float((x.abs() >= saturation_level).double().mean()),
                "nonfinite": float((~torch.isfinite(x)).sum()),
            }
        return result

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def assert_close(actual: float, expected: float, rtol: float = 1e-5, what: str = "") -> None:
    assert math.isclose(actual, expected, rel_tol=rtol, abs_tol=0.0), (
        f"{what}: {actual!r} != {expected!r} (rel err {abs(actual - expected) / abs(expected):.2e})"
    )


def assert_activations(actual: dict[str, float], expected: dict[str, float], what: str) -> None:
    """rtol 1e-5 on every field; the mean, which can sit near zero, to 1e-5 of the rms scale."""
    for key, value in expected.items():
        if key == "mean":
            assert abs(actual[key] - value) <= 1e-5 * expected["rms"], (
                f"{what}.mean {actual[key]} != {value}"
            )
        else:
            assert_close(actual[key], value, what=f"{what}.{key}") if value else (
                actual[key] == value or _fail(f"{what}.{key}: {actual[key]} != {value}")
            )


def _fail(message: str) -> None:
    raise AssertionError(message)
