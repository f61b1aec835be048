"""On a GPU: the accelerator memory vitals, read from the allocator's host counters.

These tests exist only where CUDA is available (CI has no GPU); run them on a GPU machine with
``python -m pytest tests/unit/test_cuda_vitals.py``.
"""

import warnings

import pytest
import torch
from support.models import TINY, TinyGPT, random_batches

import torchvitals
from torchvitals.agent.measure.host import accelerator_memory

pytestmark = pytest.mark.cuda

DEVICES = ["cuda"] if torch.cuda.is_available() else []
MIB = 2**20


@pytest.mark.parametrize("device", DEVICES)
def test_allocator_counters_and_peak_since_the_last_read(device):
    dev = torch.device(device)
    accelerator_memory(dev)  # resets the peak
    base = torch.cuda.memory_allocated(dev)
    held = torch.empty(64 * MIB, dtype=torch.uint8, device=dev)
    brief = torch.empty(256 * MIB, dtype=torch.uint8, device=dev)
    del brief  # gone before the read: the peak saw it
    m = accelerator_memory(dev)
    assert m["allocated_bytes"] == torch.cuda.memory_allocated(dev) >= base + 64 * MIB
    assert m["reserved_bytes"] == torch.cuda.memory_reserved(dev) >= m["allocated_bytes"]
    assert m["fragmentation_bytes"] == m["reserved_bytes"] - m["allocated_bytes"]
    assert m["peak_bytes"] >= base + (64 + 256) * MIB
    again = accelerator_memory(dev)  # the peak since the previous read
    assert again["peak_bytes"] < base + (64 + 256) * MIB
    del held


@pytest.mark.parametrize("device", DEVICES)
def test_device_leak_is_memory_growth_without_a_host_sync(device):
    torch.manual_seed(0)
    model = TinyGPT(**TINY).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    agent = torchvitals.watch(model, opt, metrics_port=0, log_dir="")
    leak, syncs, reports = [], [], []
    for step, (x, y) in enumerate(
        random_batches(110, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"]), start=1
    ):
        x, y = x.to(device), y.to(device)
        leak.append(torch.ones(2 * MIB, device=device))  # 8 MiB a step that is never freed
        loss = model.loss(x, y)
        loss.backward()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                reports.append(agent.step(loss))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if step > 1:  # step 1 uploads the block index once
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        opt.zero_grad(set_to_none=True)
    history = [(v.pattern, v.step, v.evidence.get("memory")) for v in agent.detector.history]
    agent.close()
    assert syncs == [1] * len(syncs), "the one packed copy per step, sampled steps included"
    assert ("memory_growth", 100, "accelerator_allocated_bytes") in history, history
    last = reports[-1].local.accelerator_memory
    assert last["allocated_bytes"] >= 100 * 8 * MIB
    assert reports[-1].memory["accelerator_allocated_bytes"] >= 90 * 8 * MIB
