"""torchtitan's training entry point with torchvitals: its own ``main()``, plus one line.

    TORCHVITALS_CHECKPOINT_DIR=/ckpt/torchvitals torchrun --nproc-per-node 8 \\
        examples/torchtitan_train.py --module llama3 --config llama3_debugmodel

Every torchtitan flag works as with its ``train.py``; torchvitals reads its settings from the
``TORCHVITALS_*`` variables (or pass ``Config`` fields to ``watch_torchtitan``). Needs
torchtitan 0.3.0 (docs/frameworks.md: "torchtitan").
"""

from __future__ import annotations

import torch
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger

import torchvitals


def main() -> None:
    init_logger()
    config = ConfigManager().parse_args()
    trainer = None
    agent = None
    try:
        trainer = config.build()
        agent = torchvitals.watch_torchtitan(trainer)  # the one line torchvitals adds
        trainer.train()
    finally:
        if agent is not None:
            agent.close()  # hands back the trainer's attributes
        if trainer is not None:
            trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
