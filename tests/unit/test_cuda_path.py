"""On a GPU: the same exactness on CUDA tensors, and the step's only host sync is the one copy.

These tests exist only where CUDA is available (CI has no GPU); run them on a GPU machine with
``python -m pytest tests/unit/test_cuda_path.py``.
"""

import copy
import warnings

import pytest
import torch
from support.models import TINY, TINY_BLOCKS, TinyGPT, random_batches
from support.reference import OutputRecorder, assert_close, ref_grad_norms

import torchvitals

pytestmark = pytest.mark.cuda

DEVICES = ["cuda"] if torch.cuda.is_available() else []


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_signals_match_reference(device):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = TinyGPT(**TINY).to(device)
    reference = copy.deepcopy(model).double()
    agent = torchvitals.watch(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ((x, y),) = random_batches(1, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"])
    x, y = x.to(device), y.to(device)
    recorder = OutputRecorder(reference, TINY_BLOCKS[:-1])
    reference.loss(x, y).backward()
    norms, total = ref_grad_norms(reference, TINY_BLOCKS[:-1])
    loss = model.loss(x, y)
    loss.backward()
    report = agent.step(loss)
    # float32 on the GPU against a float64 reference of the same weights: kernel order differs.
    for block, value in norms.items():
        assert_close(report.grad_norm[block], value, rtol=1e-4, what=block)
    assert_close(report.grad_norm_total, total, rtol=1e-4, what="total")
    stats = recorder.stats()
    for block in TINY_BLOCKS[:-1]:
        assert report.activations[block]["abs_max"] == pytest.approx(
            stats[block]["abs_max"], rel=1e-4
        )
    agent.close()


@pytest.mark.parametrize("device", DEVICES)
def test_one_host_sync_per_step(device):
    torch.manual_seed(0)
    model = TinyGPT(**TINY).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    agent = torchvitals.watch(model, opt, sample_every=2)
    batches = [
        (x.to(device), y.to(device))
        for x, y in random_batches(5, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"])
    ]
    for step, (x, y) in enumerate(batches, start=1):
        loss = model.loss(x, y)
        loss.backward()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                agent.step(loss)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        if step > 1:  # step 1 uploads the block index once
            assert len(syncs) == 1, [str(w.message) for w in syncs]
        opt.zero_grad(set_to_none=True)
    agent.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_skipped_update_adds_no_host_sync(device, tmp_path):
    """The ladder's first rung decides from the step's one copy: a one-step outlier's skip
    costs no sync of its own, and leaves the weights as they were."""
    model, opt, agent, batches = _watched(device, tmp_path)
    for step, (x, y) in enumerate(batches, start=1):
        loss = model.loss(x, y) * (5.0 if step == 25 else 1.0)  # a bad batch at step 25
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        report, syncs = _step_counting_syncs(agent, loss)
        if step == 25:
            assert report.action == "skip", report.verdicts
            assert "loss_outlier" in {v.pattern for v in report.verdicts}
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert len(syncs) == 1, [str(w.message) for w in syncs]
        opt.zero_grad(set_to_none=True)
    agent.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_closure_costs_no_host_sync_until_a_step_is_computed_again(device, tmp_path):
    """Passing ``closure=`` adds one host float to the step's copy, no sync: only the suspect
    step that is computed again waits for the device (its own reduction's copy)."""
    model, opt, agent, batches = _watched(device, tmp_path)
    for step, (x, y) in enumerate(batches, start=1):
        fault = 5.0 if step == 25 else 1.0

        def again(x=x, y=y) -> torch.Tensor:  # the fault does not come back: transient
            recomputed = model.loss(x, y)
            recomputed.backward()
            return recomputed

        loss = model.loss(x, y) * fault
        loss.backward()
        report, syncs = _step_counting_syncs(agent, loss, closure=again)
        if step == 25:
            assert report.remedy == "rerun" and report.rerun is not None, report.verdicts
        elif step > 1:
            assert report.rerun is None and len(syncs) == 1, [str(w.message) for w in syncs]
        opt.zero_grad(set_to_none=True)
    agent.close()


def _step_counting_syncs(agent, loss, **kwargs):
    """``agent.step(loss, **kwargs)`` and the host syncs it caused (CUDA's sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            report = agent.step(loss, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return report, [w for w in caught if "synchroniz" in str(w.message)]


def _watched(device, tmp_path):
    """TinyGPT on ``device`` under the agent with the watchdog on, and 30 batches there."""
    torch.manual_seed(0)
    model = TinyGPT(**TINY).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    agent = torchvitals.watch(
        model, opt, sample_every=1000, checkpoint_dir=str(tmp_path), checkpoint_every=1000
    )
    batches = [
        (x.to(device), y.to(device))
        for x, y in random_batches(30, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"])
    ]
    return model, opt, agent, batches
