"""One optimizer backend per kind, chosen once at ``watch()``: which kind each object gets, what
each backend answers, and the clear error for anything that is not an optimizer.

    python -m pytest tests/unit/test_backends.py
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from torchvitals.agent.backends import PartitionedState, choose
from torchvitals.agent.backends.torch_optim import ContainerBackend, TorchBackend
from torchvitals.agent.backends.zero import ZeroBackend
from torchvitals.agent.backends.zero3 import Zero3Backend
from torchvitals.agent.compat import deepspeed
from torchvitals.agent.recover.state import get_states, set_states
from torchvitals.errors import TorchvitalsError


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


class Container(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer shape: every parameter, no defaults, ``.optimizers``."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        torch.optim.Optimizer.__init__(self, params, {})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()


class Wrapper:
    """accelerate's shape: not an optimizer, but holds one as ``.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def fake_zero(module: str, optimizer: torch.optim.Optimizer, groups, dtype=torch.float32):
    """An object DeepSpeed's kind tests take for its ZeRO optimizer (of ``module``)."""
    zero = type("FakeZero", (), {"__module__": module})()
    zero.optimizer, zero.dtype, zero.averaged_gradients = optimizer, dtype, {}
    zero.bit16_groups = zero.fp16_groups = groups
    return zero


def test_a_torch_optimizer_gets_the_torch_backend():
    model = nn.Linear(3, 2)
    opt = sgd(model)
    backend = choose(opt)
    assert type(backend) is TorchBackend and backend.kind == "torch"
    assert backend.stepper is opt and backend.state_holder is opt
    assert backend.optimizers.torch_optimizers == (opt,)
    assert backend.grad_source is None and backend.param_source is None
    assert backend.stepped_params.param_groups == opt.param_groups
    backend.check_checkpointable("ckpt")  # DCP covers it


def test_a_wrapper_is_peeled_to_the_torch_optimizer_inside_and_said_once(caplog):
    opt = sgd(nn.Linear(3, 2))
    with caplog.at_level(logging.INFO, logger="test_backends"):
        backend = choose(Wrapper(Wrapper(opt)), logging.getLogger("test_backends"))
    assert type(backend) is TorchBackend and backend.stepper is opt
    [note] = [r.getMessage() for r in caplog.records]
    assert "guarding the torch optimizer torch.optim.sgd.SGD inside" in note
    assert note.count("Wrapper") == 2


def test_a_container_gets_the_container_backend_its_optimizers_inside():
    a, b = nn.Linear(3, 3), nn.Linear(3, 2)
    inner = [sgd(a), torch.optim.AdamW(b.parameters(), lr=1e-3)]
    container = Container(inner)
    backend = choose(container)
    assert type(backend) is ContainerBackend and backend.kind == "container"
    assert backend.stepper is container and backend.state_holder is container
    assert backend.optimizers.torch_optimizers == tuple(inner)
    assert [g["lr"] for g in backend.stepped_params.param_groups] == [0.1, 1e-3]


@pytest.mark.parametrize(
    "obj, says",
    [
        (nn.Linear(3, 2), "needs a torch.optim.Optimizer"),
        (Wrapper(object()), "which holds no torch optimizer"),
        ("sgd", "got builtins.str"),
    ],
)
def test_anything_else_is_refused_with_what_watch_accepts(obj, says):
    with pytest.raises(TorchvitalsError, match=says):
        choose(obj)


def test_deepspeeds_other_optimizers_are_refused_not_read_as_zeros():
    opt = sgd(nn.Linear(3, 2))
    fused = type("FP16_Optimizer", (), {"__module__": "deepspeed.runtime.fp16.fused_optimizer"})()
    fused.optimizer = opt
    with pytest.raises(TorchvitalsError, match=r"does not support DeepSpeed's .*FP16_Optimizer"):
        choose(fused)


def test_a_zero_optimizer_owns_the_step_gradients_and_state():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    flat = torch.optim.SGD([nn.Parameter(torch.zeros(4))], lr=0.1)  # its flat partition
    groups = [list(model.parameters())]
    zero = fake_zero(deepspeed.ZERO_MODULE, flat, groups)
    backend = choose(Wrapper(zero))  # accelerate around DeepSpeed
    assert type(backend) is ZeroBackend and backend.kind == "zero"
    assert backend.stepper is zero and backend.optimizers.stepped is flat
    assert backend.grad_source is deepspeed.zero_grad_fragment
    assert backend.stepped_params.param_groups == [{"params": groups[0]}]
    assert isinstance(backend.state_holder, PartitionedState)
    backend.check_checkpointable("ckpt")


def test_zero_with_fp16_is_refused():
    flat = torch.optim.SGD([nn.Parameter(torch.zeros(4))], lr=0.1)
    zero = fake_zero(deepspeed.ZERO_MODULE, flat, [[]], dtype=torch.float16)
    with pytest.raises(TorchvitalsError, match="ZeRO with fp16"):
        choose(zero)


def test_zero3_reads_partitions_and_refuses_checkpoints_when_offloaded():
    flat = torch.optim.SGD([nn.Parameter(torch.zeros(4))], lr=0.1)
    params = list(nn.Linear(3, 2).parameters())
    zero3 = fake_zero(deepspeed.ZERO3_MODULE, flat, [params])
    backend = choose(zero3)
    assert type(backend) is Zero3Backend and backend.kind == "zero3"
    assert backend.stepper is zero3
    assert backend.grad_source == backend.partitions.grad
    assert backend.param_source == backend.partitions.param
    assert backend.stepped_params.param_groups == [{"params": params}]
    assert backend.partitions.grad(params[0]) is None  # no backward pass yet
    backend.check_checkpointable("ckpt")
    zero3.offload_optimizer = True
    backend.check_checkpointable(None)  # no watchdog: nothing to refuse
    with pytest.raises(TorchvitalsError, match="offloaded"):
        backend.check_checkpointable("ckpt")


def test_a_partitioned_state_says_itself_what_checkpoints_save_and_load():
    class Partitions:
        def __init__(self):
            self.loaded = None

        def states(self, model):
            return {"rank-0": {"w": model.weight}}, {"rank-0": {"step": 3}}

        def load_states(self, model, model_sd, optim_sd):
            self.loaded = (model_sd, optim_sd)

    model, holder = nn.Linear(2, 2), Partitions()
    model_sd, optim_sd = get_states(model, holder)
    assert model_sd["rank-0"]["w"] is model.weight and optim_sd == {"rank-0": {"step": 3}}
    set_states(model, holder, model_sd, optim_sd)
    assert holder.loaded == (model_sd, optim_sd)
