"""Your own vital sign, a rule on it and a TensorBoard sink, passed to watch(): one process.

python examples/custom_vitals.py --log-dir runs/custom_vitals --steps 120 --hot-from 60
tensorboard --logdir runs/custom_vitals

The signal (the global L2 norm of the parameters), the rule (a warning when that norm grows
more than 1.2x within 20 steps) and the sink (loss, grad norms, update ratios, learning rates
and the custom signal as TensorBoard scalars) are in
``torchvitals/agent/tools/examples/custom_vitals.py``, written only against the names
``import torchvitals`` exports; docs/extending.md explains the seams. From ``--hot-from`` on the
learning rate is multiplied by 100 (AdamW, no weight decay), so the weights run away and the rule
fires; without it the run stays healthy.
"""

import argparse

import torch

import torchvitals
from torchvitals.agent.tools.demo.data import random_batches
from torchvitals.agent.tools.demo.model import TinyGPT
from torchvitals.agent.tools.examples.custom_vitals import (
    PARAM_NORM,
    ParamNorm,
    ParamNormGrowth,
    TensorBoardSink,
)

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=120)
parser.add_argument("--log-dir", default="runs/custom_vitals")
parser.add_argument("--hot-from", type=int, default=None, help="step the learning rate turns hot")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
model = TinyGPT(vocab=64, d_model=64, n_layers=2, seq_len=32).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
agent = torchvitals.watch(
    model,
    optimizer,
    signals=[ParamNorm(model)],
    rules=[ParamNormGrowth(window=20, growth=1.2)],
    sinks=[TensorBoardSink(args.log_dir)],
    log_dir="",
    metrics_port=0,
)
for inputs, targets in random_batches(args.steps, batch=8, seq_len=32, vocab=64):
    if args.hot_from is not None and agent.step_count + 1 == args.hot_from:
        for group in optimizer.param_groups:
            group["lr"] *= 100
    loss = model.loss(inputs.to(device), targets.to(device))
    loss.backward()
    report = agent.step(loss)
    optimizer.zero_grad(set_to_none=True)
    for verdict in report.verdicts:
        print(verdict, verdict.evidence)
print(f"step {report.step} loss {report.loss:.4f} {PARAM_NORM} {report.custom[PARAM_NORM]:.2f}")
agent.close()
print(f"TensorBoard: tensorboard --logdir {args.log_dir}")
