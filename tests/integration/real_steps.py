"""What the framework jobs record about each step, from the optimizer itself and the report,
how they write it and leave, and how the tests launch them (``torchrun``, ``read_ranks``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def record_real_steps(optimizer: torch.optim.Optimizer, into: list[dict[str, float]]) -> None:
    """Append the learning rate and the gradient norm of every real step of ``optimizer``: its
    own pre-step hook runs inside the real step only, after the framework clipped."""

    def real_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        norm = math.sqrt(
            sum(
                float(p.grad.double().pow(2).sum())
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None
            )
        )
        into.append({"lr": opt.param_groups[0]["lr"], "grad_norm": norm})

    optimizer.register_step_pre_hook(real_step)


def nan_at(
    model: torch.nn.Module,
    state: Any,
    rank: int,
    fault_step: int,
    micro_losses: list[float] | None = None,
) -> None:
    """Make rank 1's loss NaN on one micro-batch of the Trainer's ``global_step == fault_step``
    (once); each micro-batch's true loss is appended to ``micro_losses`` when given."""
    original, fired = model.forward, []

    def forward(*a: Any, **kw: Any) -> Any:
        out = original(*a, **kw)
        if micro_losses is not None:
            micro_losses.append(out.loss.item())
        if rank == 1 and state.global_step == fault_step and not fired:
            fired.append(fault_step)
            out.loss = out.loss * float("nan")
        return out

    model.forward = forward


def describe(report: Any) -> dict[str, Any]:
    """The report's fields the tests assert on, as JSON."""
    return {
        "step": report.step,
        "action": report.action,
        "loss": report.loss,
        "lr": report.lr,
        "grad_norm_total": report.grad_norm_total,
        "rollback": report.rollback.to_dict() if report.rollback else None,
        "verdicts": [v.pattern for v in report.verdicts],
    }


def finish(agent: Any, path: str, record: dict[str, Any]) -> None:
    """Write this rank's ``record`` as JSON to ``path`` and close the agent."""
    with open(path, "w") as f:
        json.dump(record, f)
    agent.close()


def exit_after(main: Callable[[], None]) -> None:
    """Run a job's ``main`` and leave at once (no interpreter teardown, where DeepSpeed's and
    accelerate's process groups can hang a torchrun worker)."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun(
    script: Path,
    out: Path,
    *args: str,
    timeout: int = 400,
    job_id: str | None = None,
    nproc: int = 2,
) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun on CPU (DeepSpeed's CPU accelerator, gloo) from ``out``,
    with no TORCHVITALS_* variable of this process, and ``job_id`` as TORCHVITALS_JOB_ID (a
    restart continues the checkpoint folder of the same job only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHVITALS_")}
    if job_id is not None:
        env["TORCHVITALS_JOB_ID"] = job_id
    env.update(
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=env.get("PYTHONPATH", ""),
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(script),
            *args,
        ],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_ranks(out: Path, world: int = 2) -> list[dict[str, Any]]:
    """Every rank's ``rank<r>.json``, checked to have decided the same action at every step."""
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for other in ranks[1:]:
        assert [(r["step"], r["action"]) for r in ranks[0]["reports"]] == [
            (r["step"], r["action"]) for r in other["reports"]
        ], "the ranks decided differently"
    return ranks
