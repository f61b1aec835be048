"""torchtitan's own Trainer under torchvitals, one rank of a 2-rank gloo job on CPU.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/integration/titan_job.py \
        --out /tmp/titan --steps 20 [--fault-step 12 --fault-rank 1] [--checkpoint-dir DIR] \
        [--titan-folder DIR --titan-interval 5]

Writes ``rank<r>.json``: torchtitan's own logged loss and grad norm per step, the agent's
reports, the LR each inner optimizer really stepped with, the scheduler's LR, the final
step counters and the watchdog's back-off, skip list and ledger. ``--titan-folder`` turns
torchtitan's own checkpointer on (that folder, every ``--titan-interval`` steps, the last one a
full checkpoint so a longer run can continue it): the way torchtitan users restart;
``--stop-after`` ends the run after that step as a crash would, before its last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import titan_harness  # first: the CPU harness (sorted first as well)
import torch

import torchvitals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fault-step", type=int, default=0)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--checkpoint-dir", default="")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--resume", action="store_true", help="continue the checkpoint_dir's run")
    parser.add_argument("--pipeline", type=int, default=1, help="pipeline stages (1F1B)")
    parser.add_argument("--titan-folder", default="")
    parser.add_argument("--titan-interval", type=int, default=5)
    parser.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="end after this model step, as a crash would (no last checkpoint)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    config = titan_harness.debug_llama3(args.out, steps=args.steps, pipeline=args.pipeline)
    if args.titan_folder:
        config.checkpoint.enable = True
        config.checkpoint.folder = args.titan_folder
        config.checkpoint.interval = args.titan_interval
        config.checkpoint.last_save_model_only = False
    trainer = config.build()
    if args.stop_after:
        trainer.should_continue_training = lambda: trainer.step < args.stop_after
    me = titan_harness.rank()
    titan_loss: dict[int, float] = {}
    titan_norm: dict[int, float] = {}
    log = trainer.metrics_processor.log

    titan_log: list[tuple[int, float, float]] = []  # in order (a rolled-back step repeats)

    def logged(step, loss, max_loss, grad_norm, *a, **k):
        titan_loss[step], titan_norm[step] = float(loss), float(grad_norm)
        titan_log.append((step, float(loss), float(grad_norm)))
        return log(step, loss, max_loss, grad_norm, *a, **k)

    trainer.metrics_processor.log = logged

    injected = []
    loss_fn = trainer.loss_fn

    def faulty(*a, **k):
        loss, rest = loss_fn(*a, **k)
        if trainer.step == args.fault_step and me == args.fault_rank and not injected:
            injected.append(trainer.step)
            loss = loss * float("nan")
        return loss, rest

    if args.pipeline > 1:  # the last stage's schedule computes the loss (its own closure)
        loss_of = trainer.pp_schedule._compute_loss

        def faulty_stage(*a, **k):
            loss = loss_of(*a, **k)
            if trainer.step == args.fault_step and me == args.fault_rank and not injected:
                injected.append(trainer.step)
                loss = loss * float("nan")
            return loss

        trainer.pp_schedule._compute_loss = faulty_stage
    else:
        trainer.loss_fn = faulty

    stepped_lr: list[list[float]] = []
    for opt in trainer.optimizers.optimizers:
        opt.register_step_pre_hook(
            lambda o, a, k: stepped_lr.append([float(g["lr"]) for g in o.param_groups])
        )

    extra = (
        {
            "checkpoint_dir": args.checkpoint_dir,
            "checkpoint_every": args.checkpoint_every,
            "healthy_window": 0,
            # The scenarios' faults come two steps after a checkpoint, which they roll back to.
            "trust_steps": 1,
        }
        if args.checkpoint_dir
        else {}
    )
    if args.resume:
        extra["resume"] = "auto"
    agent = torchvitals.watch_torchtitan(trainer, metrics_port=0, log_dir="", **extra)
    reports = []
    orig_step = trainer.train_step

    def recording(it):
        scheduled = trainer.lr_schedulers.schedulers[0].get_last_lr()  # this step's, before it
        try:
            return orig_step(it)
        finally:
            r = agent.last_report
            if r is not None and (not reports or reports[-1]["id"] != id(r)):
                reports.append(
                    {
                        "id": id(r),
                        "step": r.step,
                        "loss": r.loss,
                        "action": r.action,
                        "grad_norm_total": r.grad_norm_total,
                        "lr": list(r.lr),
                        "rollback": r.rollback.to_dict() if r.rollback else None,
                        "titan_step": trainer.step,
                        "scheduled_lr": scheduled,
                    }
                )

    trainer.train_step = recording
    try:
        trainer.train()
    finally:
        watchdog = agent.watchdog
        checkpoints = agent.adapter.checkpoints
        adopted = checkpoints.adopted if checkpoints is not None else None
        result = {
            "blocks": agent.block_names,
            "kinds": agent._blocks.kinds,
            "reports": reports,
            "titan_loss": titan_loss,
            "titan_norm": titan_norm,
            "titan_log": titan_log,
            "stepped_lr": stepped_lr,
            "final_step": trainer.step,
            "agent_step": agent.step_count,
            "absorbed": agent.adapter.absorbed,
            "verdicts": [str(v) for v in agent.detector.history if v.severity != "info"],
            "injected": injected,
            "resumed_from": agent.resumed_from,
            "sched_last_epoch": trainer.lr_schedulers.schedulers[0].last_epoch,
            "lr_scale": watchdog.lr_scale if watchdog else None,
            "skipped": [list(r) for r in watchdog.ledger.skipped] if watchdog else None,
            "recent_rollbacks": (
                watchdog.rollback_policy.recent(agent.ticks) if watchdog else None
            ),
            "ledger": watchdog.ledger.entries if watchdog else None,
            "adopted": vars(adopted) if adopted is not None else None,
            "finite_params": all(
                bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                for p in trainer.model_parts[0].parameters()
            ),
        }
        agent.close()
        trainer.close()
        (args.out / f"rank{me}.json").write_text(json.dumps(result, default=str))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
