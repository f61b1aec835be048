"""The patches an agent installs (the optimizer's ``step`` and ``zero_grad``,
``GradScaler.step``, ``Module.zero_grad`` and a module class's own ``zero_grad``, the function
``clip_grad_norm_`` scales through) are in place while it watches, gone after ``close()`` and
after the agent is dropped without it, never clobber a wrapper someone installed after them, and
are shared by two agents in one process. The private torch names they and the rest of the
package rely on hold in the installed torch."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad

import torchvitals
from torchvitals.agent import compat, patches
from torchvitals.agent.patches import AttributePatch, ForeignPatchWarning, PatchSet

SCALER_STEP = torch.amp.GradScaler.step
SCALE_GRADS = clip_grad._clip_grads_with_norm_
PUBLIC_SCALE_GRADS = torch.nn.utils.clip_grads_with_norm_
MODULE_ZERO_GRAD = nn.Module.zero_grad


def restored() -> bool:
    """Every process-wide patch is torch's own again."""
    return (
        torch.amp.GradScaler.step is SCALER_STEP
        and clip_grad._clip_grads_with_norm_ is SCALE_GRADS
        and torch.nn.utils.clip_grads_with_norm_ is PUBLIC_SCALE_GRADS
        and nn.Module.zero_grad is MODULE_ZERO_GRAD
    )


@pytest.fixture(autouse=True)
def torch_as_found():
    """Whatever a test leaves patched (a foreign wrapper on purpose) is put back after it."""
    yield
    torch.amp.GradScaler.step = SCALER_STEP
    clip_grad._clip_grads_with_norm_ = SCALE_GRADS
    torch.nn.utils.clip_grads_with_norm_ = PUBLIC_SCALE_GRADS
    nn.Module.zero_grad = MODULE_ZERO_GRAD


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def backward(model: nn.Module, seed: int, scaler: torch.amp.GradScaler | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=gen)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()


def grad_total(model: nn.Module) -> float:
    return float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())


def watched(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torchvitals.Agent]:
    model = mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt, torchvitals.watch(model, opt, log_dir="", metrics_port=0)


def test_every_private_torch_name_torchvitals_relies_on_holds_in_this_torch():
    """A torch upgrade that renames one fails here, naming it."""
    compat.check()
    assert compat.torch_series("2.13.1+cu128") == compat.SUPPORTED_TORCH


def test_each_patch_is_installed_while_the_agent_watches_and_gone_after_close():
    model, opt, agent = watched()
    assert "step" in vars(opt) and opt.step.__self__ is opt
    assert torch.amp.GradScaler.step is not SCALER_STEP
    assert torch.amp.GradScaler.step.__wrapped__ is SCALER_STEP
    assert clip_grad._clip_grads_with_norm_ is torch.nn.utils.clip_grads_with_norm_
    assert clip_grad._clip_grads_with_norm_.__wrapped__ is SCALE_GRADS
    assert "zero_grad" in vars(opt) and nn.Module.zero_grad.__wrapped__ is MODULE_ZERO_GRAD
    # Each acts: the step runs the agent, the clipping is measured before it clips, the
    # scaler's step is the agent's.
    backward(model, 0)
    before = grad_total(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), before / 10)
    opt.step()
    assert agent.step_count == 1
    assert agent.last_report.grad_norm_total == pytest.approx(before, rel=1e-5)
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    backward(model, 1, scaler)
    scaler.step(opt)
    scaler.update()
    assert agent.step_count == 2 and agent.last_report.loss_scale == 2.0**4
    agent.close()
    assert "step" not in vars(opt) and "zero_grad" not in vars(opt) and restored()
    assert patches.ZERO_GRAD._leases == 0
    agent.close()  # idempotent
    assert restored()


def test_an_agent_dropped_without_close_is_collected_and_its_patches_undone():
    """Nothing but the model and the optimizer hold the agent: dropping the three lets the
    collector take them, and the agent's finalizer puts every shared patch back."""
    model, opt, agent = watched()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for seed in range(3):  # every route used once
        backward(model, seed, scaler)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert agent.step_count == 3 and not restored()
    gone = weakref.ref(agent)
    del model, opt, agent
    gc.collect()
    assert gone() is None, [type(r) for r in gc.get_referrers(gone())]
    assert restored() and patches.SCALER_STEP._leases == 0 and patches.CLIPPING._leases == 0
    assert patches.ZERO_GRAD._leases == 0


def test_a_wrapper_installed_on_the_optimizer_after_watch_survives_close_and_still_steps():
    model, opt, agent = watched()
    guarded, calls = opt.step, []

    def profiler_step(*args, **kwargs):
        calls.append(1)
        return guarded(*args, **kwargs)

    opt.step = profiler_step
    backward(model, 0)
    opt.step()
    assert agent.step_count == 1 and calls == [1]
    with pytest.warns(ForeignPatchWarning, match="SGD.step"):
        agent.close()
    assert opt.step is profiler_step, "the newer wrapper stays"
    opt.zero_grad()
    backward(model, 1)
    weight = model[0].weight.detach().clone()
    opt.step()  # through the closed guard: the real step
    assert calls == [1, 1] and agent.step_count == 1
    assert not torch.equal(model[0].weight, weight)


def test_a_wrapper_installed_on_the_scaler_after_watch_survives_close_and_still_steps():
    model, opt, agent = watched()
    patched, calls = torch.amp.GradScaler.step, []

    def traced(scaler, optimizer, *args, **kwargs):
        calls.append(1)
        return patched(scaler, optimizer, *args, **kwargs)

    torch.amp.GradScaler.step = traced
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    backward(model, 0, scaler)
    scaler.step(opt)
    scaler.update()
    assert agent.step_count == 1 and calls == [1]
    with pytest.warns(ForeignPatchWarning, match="GradScaler.step"):
        agent.close()
    assert torch.amp.GradScaler.step is traced
    assert clip_grad._clip_grads_with_norm_ is SCALE_GRADS, "the others are put back"
    opt.zero_grad()
    backward(model, 1, scaler)
    weight = model[0].weight.detach().clone()
    scaler.step(opt)  # the buried wrapper passes it to torch's
    scaler.update()
    assert calls == [1, 1] and agent.step_count == 1
    assert not torch.equal(model[0].weight, weight)


def test_a_wrapper_installed_on_clipping_after_watch_survives_close_and_still_clips():
    model, _, agent = watched()
    patched, calls = clip_grad._clip_grads_with_norm_, []

    def traced(parameters, *args, **kwargs):
        calls.append(1)
        return patched(parameters, *args, **kwargs)

    clip_grad._clip_grads_with_norm_ = traced
    with pytest.warns(ForeignPatchWarning, match="_clip_grads_with_norm_"):
        agent.close()
    assert clip_grad._clip_grads_with_norm_ is traced
    assert torch.nn.utils.clip_grads_with_norm_ is PUBLIC_SCALE_GRADS
    backward(model, 0)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    assert calls == [1] and float(norm) > 0.01
    assert grad_total(model) == pytest.approx(0.01, rel=1e-3)


def test_an_optimizer_step_put_back_by_someone_else_is_accepted_quietly():
    """accelerate sets ``optimizer.step`` back to the method it saw before ``watch``."""
    _, opt, agent = watched()
    opt.step = torch.optim.SGD.step.__get__(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForeignPatchWarning)
        agent.close()
    assert restored()


def test_two_agents_in_one_process_share_the_patches_until_the_last_closes():
    (m1, o1, a1), (m2, o2, a2) = watched(0), watched(1)
    assert patches.SCALER_STEP._leases == 2 and patches.CLIPPING._leases == 2
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for model, opt in ((m1, o1), (m2, o2)):
        backward(model, 0, scaler)
        scaler.step(opt)
    scaler.update()
    assert a1.step_count == 1 and a2.step_count == 1
    a1.close()
    assert not restored() and "step" not in vars(o1)
    o2.zero_grad()
    backward(m2, 1, scaler)
    scaler.unscale_(o2)
    total = grad_total(m2)
    torch.nn.utils.clip_grad_norm_(m2.parameters(), total / 10)
    scaler.step(o2)  # still the second agent's
    scaler.update()
    assert a2.step_count == 2 and a1.step_count == 1
    assert a2.last_report.grad_norm_total == pytest.approx(total, rel=1e-5), "before clipping"
    a2.close()
    assert restored()


class Owner:
    value = "class"


def test_an_attribute_patch_restores_only_its_own_replacement_and_only_once():
    owner = Owner()
    patch = AttributePatch(owner, "value", lambda found: f"wrapped {found}")
    patch.install()
    assert owner.value == "wrapped class" and patch.wrapped == "class"
    assert patch.uninstall() and "value" not in vars(owner) and owner.value == "class"
    assert patch.uninstall()  # a second uninstall does nothing
    owner.value = "own"
    mine = AttributePatch(owner, "value", lambda found: f"wrapped {found}")
    mine.install()
    owner.value = "someone else's"
    with pytest.warns(ForeignPatchWarning, match="value"):
        assert not mine.uninstall()
    assert owner.value == "someone else's"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForeignPatchWarning)
        assert mine.uninstall()  # warned once; nothing left to undo


def test_a_patch_set_is_closed_by_its_owners_finalizer_without_holding_the_owner():
    class Holder:
        def capture(self) -> None:
            self.captured = True

    holder, params = Holder(), [nn.Parameter(torch.ones(3))]
    params[0].grad = torch.ones(3)
    patches_ = PatchSet()
    patches_.close_when_collected(holder)
    patches_.capture_clipping(holder.capture, params)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert holder.captured and not restored()
    gone = weakref.ref(holder)
    del holder
    gc.collect()
    assert gone() is None and restored() and patches_.closed


def test_a_route_must_be_held_weakly():
    with pytest.raises(TypeError, match="bound method"):
        PatchSet().capture_clipping(lambda: None, [])
    assert restored()


class OwnZeroGrad(nn.Module):
    """A module whose class clears its gradients itself (DeepSpeed's engine does): ``watch``
    patches its ``zero_grad`` on the instance, since ``Module.zero_grad``'s patch misses it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.cleared = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.cleared += 1
        for p in self.parameters():
            p.grad = None


def own_zero_grad_is_back(model: OwnZeroGrad) -> bool:
    """Nothing of torchvitals on the instance: ``zero_grad`` is its class's, run once a call."""
    if "zero_grad" in vars(model) or model.zero_grad.__func__ is not OwnZeroGrad.zero_grad:
        return False
    before = model.cleared
    model.zero_grad()
    return model.cleared == before + 1


def test_a_module_with_its_own_zero_grad_is_left_without_the_patch_after_close():
    """The instance patch on a class's own ``zero_grad`` runs while the agent watches and is
    gone after ``close()``: the model's ``zero_grad`` is its class's again."""
    model = OwnZeroGrad()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = torchvitals.watch(model, opt, log_dir="", metrics_port=0)
    assert "zero_grad" in vars(model), "the class's own zero_grad is patched on the instance"
    backward(model, 0)
    opt.step()
    model.zero_grad()
    assert agent.step_count == 1 and model.cleared == 1
    agent.close()
    assert own_zero_grad_is_back(model) and "zero_grad" not in vars(opt) and restored()
    assert patches.ZERO_GRAD._leases == 0


def test_a_module_with_its_own_zero_grad_is_collected_with_an_agent_dropped_without_close():
    """The model holds the agent (its forward hooks), so dropping the agent means dropping the
    model too: the instance patch keeps neither alive, and the shared patches are put back."""
    model = OwnZeroGrad()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = torchvitals.watch(model, opt, log_dir="", metrics_port=0)
    backward(model, 0)
    opt.step()
    model.zero_grad()
    gone = (weakref.ref(agent), weakref.ref(model))
    del model, opt, agent
    gc.collect()
    assert [ref() for ref in gone] == [None, None] and restored()
    assert patches.ZERO_GRAD._leases == 0


def test_a_patch_set_undoes_a_class_zero_grad_patch_when_its_owner_is_collected():
    """The path a failed ``watch`` takes (its ExitStack calls ``close``) and a collected owner's
    (the finalizer does): the instance patch is there to undo, nothing else holding it."""

    class Holder:
        settled = 0

        def settle(self) -> None:
            self.settled += 1

    for ends in ("close", "collected"):
        model, holder = OwnZeroGrad(), Holder()
        patch_set = PatchSet()
        patch_set.close_when_collected(holder)
        patch_set.before_model_zero_grad(model, holder.settle)
        gc.collect()
        model.zero_grad()
        assert holder.settled == 1 and model.cleared == 1
        if ends == "close":
            patch_set.close()
        else:
            del holder
            gc.collect()
        assert patch_set.closed and own_zero_grad_is_back(model), ends
