"""watch() and close() in one process: a failed watch() leaves nothing behind (its port, its log,
its hooks and patches, the stack signal), and any number of cycles (a sweep,
``Trainer.train()`` called twice) starts clean each time. Ports are bound for real, so these
run in the integration tier.

    python -m pytest tests/integration/test_watch_lifecycle.py
"""

import signal
import socket

import psutil
import pytest
import torch
from support.models import TINY, TinyGPT, random_batches
from torch.amp.grad_scaler import GradScaler
from torch.nn.utils import clip_grad

import torchvitals
from torchvitals.agent.recover.watchdog import ResumeRefused
from torchvitals.agent.tools.demo.ports import free_ports
from torchvitals.protocol import STACK_SIGNAL, read_rank_beats

ORIGINAL = (GradScaler.step, clip_grad._clip_grads_with_norm_, torch.nn.utils.clip_grads_with_norm_)
BATCHES = list(random_batches(8, batch=2, seq_len=TINY["seq_len"], vocab=TINY["vocab"]))


def build():
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model, opt, agent, steps):
    for x, y in BATCHES[:steps]:
        loss = model.loss(x, y)
        loss.backward()
        agent.step(loss)
        opt.zero_grad(set_to_none=True)


def untouched(model, opt):
    """Nothing of torchvitals is left on the objects and the process."""
    return (
        "step" not in vars(opt)
        and not opt._optimizer_step_pre_hooks
        and not model._forward_hooks
        and (
            GradScaler.step,
            clip_grad._clip_grads_with_norm_,
            torch.nn.utils.clip_grads_with_norm_,
        )
        == ORIGINAL
    )


def bindable(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    return True


def test_a_failed_watch_releases_the_port_the_log_the_hooks_and_the_patches(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    model, opt = build()
    with torchvitals.watch(
        model, opt, checkpoint_dir=ckpt, checkpoint_every=2, healthy_window=0
    ) as agent:
        train(model, opt, agent, 4)
    assert untouched(model, opt)

    port = free_ports(1)
    model, opt = build()
    with pytest.raises(ResumeRefused):
        torchvitals.watch(
            model,
            opt,
            checkpoint_dir=ckpt,
            resume="never",
            metrics_port=port,
            log_dir=str(tmp_path / "runs"),
            run_name="refused",
        )
    assert untouched(model, opt)
    assert bindable(port), "the /metrics port of the failed watch() is still bound"
    log = str(tmp_path / "runs" / "refused" / "events.jsonl")
    assert not [f for f in psutil.Process().open_files() if f.path == log], "event log left open"

    # Nothing half-built stands in the way of the next try.
    with torchvitals.watch(
        model,
        opt,
        checkpoint_dir=ckpt,
        resume="auto",
        metrics_port=port,
        log_dir=str(tmp_path / "runs"),
        run_name="resumed",
    ) as agent:
        assert agent.resumed_from == 4 and agent.metrics_url is not None
        train(model, opt, agent, 2)
        assert agent.step_count == 6
    assert untouched(model, opt)


def test_six_watch_close_cycles_with_checkpoints_resume_each_time(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    model, opt = build()
    for cycle in range(6):
        agent = torchvitals.watch(
            model, opt, checkpoint_dir=ckpt, checkpoint_every=2, healthy_window=0, resume="auto"
        )
        assert agent.step_count == 2 * cycle
        train(model, opt, agent, 2)
        agent.close()
        assert untouched(model, opt), f"cycle {cycle} left something behind"


def test_an_agent_dropped_without_close_frees_its_port_and_threads(tmp_path):
    import gc
    import threading
    import weakref

    port = free_ports(1)
    model, opt = build()
    agent = torchvitals.watch(model, opt, metrics_port=port, log_dir=str(tmp_path))
    train(model, opt, agent, 2)
    gone = weakref.ref(agent)
    del model, opt, agent
    gc.collect()
    assert gone() is None
    assert bindable(port), "a collected agent still holds its /metrics port"
    assert not [t for t in threading.enumerate() if t.name.startswith("torchvitals-metrics")]


def test_a_failed_watch_gives_the_signal_back(tmp_path):
    from torchvitals.agent.outputs.exporter import MetricsPortError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        torch.manual_seed(0)
        model = TinyGPT(**TINY)
        with pytest.raises(MetricsPortError):
            torchvitals.watch(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                heartbeat_dir=str(tmp_path),
                log_dir="",
                metrics_port=port,
                metrics_port_strict=True,
            )
    assert signal.getsignal(STACK_SIGNAL) == signal.SIG_DFL
    assert read_rank_beats(tmp_path)[0].stack_signal is None
