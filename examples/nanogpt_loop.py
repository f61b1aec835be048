"""A nanoGPT-shaped training loop under torchvitals: two lines differ from the original.

    python examples/nanogpt_loop.py --out runs/nanogpt
    torchrun --standalone --nproc-per-node 2 examples/nanogpt_loop.py --out runs/nanogpt

The loop is the one nanoGPT's train.py runs: it sets the learning rate by hand every iteration
(warmup, then cosine), accumulates gradients over micro-batches, scales them with a GradScaler,
unscales and clips them itself, and draws its batches at random with ``torch.randint``. It ships
with the package, so the tests run this very loop: ``torchvitals/agent/tools/examples/nanogpt.py``
(``train``). torchvitals adds two lines, marked ``# torchvitals`` there:

    agent = torchvitals.watch(model, optimizer, checkpoint_dir=..., resume="auto")  # torchvitals
    while iter_num < s.max_iters:
        for group in optimizer.param_groups:        # the loop owns the LR, as nanoGPT does
            group["lr"] = get_lr(iter_num, s)
        for micro_step in range(s.grad_accum):
            ...                                     # forward, loss
            agent.record_loss(loss)                                                 # torchvitals
            scaler.scale(loss / s.grad_accum).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        scaler.step(optimizer)                      # goes through the agent
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

The loop's own ``scaler.step(optimizer)`` runs the agent's step, the steps the scaler skips for
an overflow included; with no scaler (or a disabled one) ``optimizer.step()`` goes through the
agent just the same. The back-off of a rollback applies over the hand-set LR, the gradients are
measured before the loop clips them, and after a rollback the loop's RNGs are re-seeded, so the
random batch that broke the run is not drawn again.
"""

from __future__ import annotations

import argparse
import os

from torchvitals.agent.tools.examples.nanogpt import Settings, train

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=Settings.out)
    parser.add_argument("--max-iters", type=int, default=Settings.max_iters)
    parser.add_argument("--dtype", default=Settings.dtype, choices=["float32", "float16"])
    a = parser.parse_args()
    result = train(Settings(out=a.out, max_iters=a.max_iters, dtype=a.dtype))
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"{result.iterations} iterations, model step {result.steps}, loss "
            f"{result.first_loss:.3f} -> {result.final_loss:.3f}, "
            f"{len(result.rollbacks)} rollbacks, lr scale {result.lr_scale:g}"
        )
