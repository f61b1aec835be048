"""One backend per kind of optimizer, chosen once at ``watch()``: the only place that knows
where a kind keeps its gradients, its partitions and its state.

    backend = choose(optimizer, log)   # an OptimizerBackend
    backend.stepper                    # whose step() the guard takes
    backend.optimizers                 # the torch optimizers (their LRs)
    backend.state_holder               # what checkpoints save and restore
    backend.grad_source                # where gradients are read (None: param.grad)

    base.py         ``OptimizerBackend`` (what the agent asks), ``PartitionedState``
    choose.py       which backend an optimizer gets
    torch_optim.py  a torch optimizer, a container of them (torchtitan's shape)
    zero.py         DeepSpeed ZeRO-1/2: fragments of the gradients, partitioned state
    zero3.py        DeepSpeed ZeRO-3: partitioned parameters, gradients and state
    optimizers.py   the torch optimizers behind what the loop steps (``resolve``)
    wrappers.py     accelerate's and DeepSpeed's wrappers peeled to the optimizer inside

Below every stage of the agent (``measure``, ``recover`` and the rest may import it, it imports
none of them; ``tests/unit/test_layout.py`` holds that). The private names of each framework are
read through ``agent/compat``.
"""

from __future__ import annotations

from .base import OptimizerBackend, PartitionedState
from .choose import choose

__all__ = ["OptimizerBackend", "PartitionedState", "choose"]
