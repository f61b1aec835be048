"""Train a small GPT on one process with torchvitals watching, printing the per-block signals.

    python examples/quickstart.py --steps 60

While it runs, `curl http://127.0.0.1:19400/metrics` shows the Prometheus series; the event log
lands in torchvitals_runs/<run>/events.jsonl.
"""

from __future__ import annotations

import argparse

import torch

import torchvitals
from torchvitals.agent.tools.demo.data import random_batches
from torchvitals.agent.tools.demo.model import TinyGPT


def _num(values: dict, key: str, width: int, fmt: str) -> str:
    """A right-aligned number, or blank where the block has no such value ("other")."""
    return f"{values[key]:>{width}{fmt}}" if key in values else " " * width


def show(report: torchvitals.Report) -> None:
    print(
        f"step {report.step:4d}  loss {report.loss:7.4f}  grad_norm_total "
        f"{report.grad_norm_total:8.4f}  action {report.action}"
    )
    if not report.activations:
        return
    print(
        f"  {'block':<12} {'grad_norm':>10} {'update_ratio':>13} {'act_rms':>9} "
        f"{'act_abs_max':>12} {'zero_frac':>10}"
    )
    for name, norm in report.grad_norm.items():
        ratio = report.update_ratio.get(name)
        act = report.activations.get(name, {})
        print(
            f"  {name:<12} {norm:>10.4f} {'' if ratio is None else f'{ratio:.2e}':>13} "
            f"{_num(act, 'rms', 9, '.3f')} {_num(act, 'abs_max', 12, '.3f')} "
            f"{_num(act, 'zero_fraction', 10, '.4f')}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="base port of /metrics (default: TORCHVITALS_METRICS_PORT or 19400; 0 = off)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, d_model=128, n_layers=4, n_heads=4, seq_len=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    overrides = {} if args.metrics_port is None else {"metrics_port": args.metrics_port}
    with torchvitals.watch(model, optimizer, scheduler, **overrides) as agent:
        if agent.metrics_url:
            print(f"metrics: {agent.metrics_url}")
        for inputs, targets in random_batches(args.steps, batch=16, seq_len=64, vocab=128):
            loss = model.loss(inputs, targets)
            loss.backward()
            report = agent.step(loss, samples=inputs.shape[0])
            optimizer.zero_grad(set_to_none=True)
            if report.activations or report.step == args.steps:
                show(report)
            for verdict in report.verdicts:
                print(f"  verdict: {verdict}  {verdict.evidence}")
        print(agent.diagnose().render())
        if getattr(agent, "run_dir", None):
            print(f"event log: {agent.run_dir}/events.jsonl")


if __name__ == "__main__":
    main()
