"""Beside a real cluster's exporters, the monitoring never stops the training.

    python -m pytest tests/integration/test_beside_cluster.py

- Another process holds torchvitals' default port and dcgm-exporter's 9400: the training runs,
  /metrics answers at ``agent.metrics_url``, and one warning names the taken port.
- A real Prometheus finds a rank that fell back to another port through its file_sd target.
- Two ranks started the way ``srun`` starts them (``SLURM_LOCALID``, no ``LOCAL_RANK``) on one
  host serve on their own ports, base + 0 and base + 1, with no fallback needed.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from promstack import Prometheus
from support.models import TINY, TinyGPT, random_batches
from support.world import free_port

import torchvitals
from torchvitals.agent.outputs.ports import DEFAULT_PORT
from torchvitals.agent.tools.demo.ports import free_ports, port_is_free

HOLDER = textwrap.dedent("""
    import socket, sys, time
    held = []
    for port in map(int, sys.argv[1:]):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        except OSError:
            s.close()      # already held by something else on this host: taken all the same
    print("held", flush=True)
    time.sleep(120)
""")


def answers(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


def test_default_port_and_dcgm_port_held_by_another_process(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("TORCHVITALS_METRICS_PORT", raising=False)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(DEFAULT_PORT), "9400"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not port_is_free(DEFAULT_PORT) and not port_is_free(9400)
        torch.manual_seed(0)
        model = TinyGPT(**TINY)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with caplog.at_level(logging.WARNING):
            agent = torchvitals.watch(model, opt, log_dir=str(tmp_path))  # the default port
            try:
                for x, y in random_batches(
                    6, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=0
                ):
                    loss = model.loss(x, y)
                    loss.backward()
                    report = agent.step(loss)
                    opt.zero_grad(set_to_none=True)
                assert report.step == 6 and report.action == "step"
                url = agent.metrics_url
                assert url is not None and f":{DEFAULT_PORT}/" not in url
                assert 'torchvitals_steps_total{rank="0"} 6.0' in answers(url)
            finally:
                agent.close()
    finally:
        holder.kill()
        holder.wait(timeout=10)
    named = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and f"port {DEFAULT_PORT} " in r.getMessage()
    ]
    assert len(named) == 1, [r.getMessage() for r in caplog.records]
    assert url in named[0].getMessage()


def _srun_rank(procid: int, world: int, master_port: int, metrics_base: int, out: str) -> None:
    """A rank as ``srun`` starts it: SLURM_* variables, no torchrun ones."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    os.environ.update(
        SLURM_PROCID=str(procid),
        SLURM_LOCALID=str(procid),
        SLURM_NTASKS=str(world),
        SLURM_NTASKS_PER_NODE=str(world),
    )
    import torch.distributed as dist

    torch.set_num_threads(1)
    # What an srun batch script does: the global rank from SLURM_PROCID.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{master_port}",
        rank=int(os.environ["SLURM_PROCID"]),
        world_size=int(os.environ["SLURM_NTASKS"]),
    )
    try:
        torch.manual_seed(0)
        model = TinyGPT(**TINY)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        # Strict: had SLURM_LOCALID been ignored, the second rank's bind would raise here.
        agent = torchvitals.watch(
            model, opt, metrics_port=metrics_base, metrics_port_strict=True, log_dir=""
        )
        for x, y in random_batches(
            3, batch=2, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=procid
        ):
            loss = model.loss(x, y)
            loss.backward()
            agent.step(loss)
            opt.zero_grad(set_to_none=True)
        body = answers(agent.metrics_url)
        dist.barrier()  # both ranks scraped themselves before either closes
        with open(out, "w") as f:
            json.dump({"url": agent.metrics_url, "served": f'rank="{procid}"' in body}, f)
        agent.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_srun_ranks_on_one_host_serve_on_distinct_ports(tmp_path):
    base, master = free_ports(2), free_port()
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    procs = [ctx.Process(target=_srun_rank, args=(r, 2, master, base, outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("an srun-style rank hung")
    assert [p.exitcode for p in procs] == [0, 0]
    got = [json.loads(Path(o).read_text()) for o in outs]
    assert [g["url"] for g in got] == [f"http://127.0.0.1:{base + r}/metrics" for r in range(2)]
    assert all(g["served"] for g in got)


def test_prometheus_finds_the_fallback_port_through_file_sd(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    targets = tmp_path / "targets"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port()))
        busy.listen()
        taken_port = busy.getsockname()[1]
        model = TinyGPT(**TINY)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        agent = torchvitals.watch(
            model, opt, metrics_port=taken_port, log_dir="", metrics_file_sd_dir=str(targets)
        )
    prom = None
    try:
        served = agent.metrics_url.split("://")[1].removesuffix("/metrics")
        assert served != f"127.0.0.1:{taken_port}"
        for x, y in random_batches(
            4, batch=2, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=0
        ):
            loss = model.loss(x, y)
            loss.backward()
            agent.step(loss)
            opt.zero_grad(set_to_none=True)
        prom = Prometheus(tmp_path / "prom", {}, [], file_sd={"found": str(targets / "*.json")})
        deadline = time.monotonic() + 30
        while True:
            got = prom.query('torchvitals_steps_total{job="found"}')
            if got:
                break
            assert time.monotonic() < deadline, f"never scraped:\n{prom.tail()}"
            time.sleep(0.5)
        assert got[0]["metric"]["instance"] == served and got[0]["value"][1] == "4"
    finally:
        if prom is not None:
            prom.stop()
        agent.close()
    assert not list(targets.glob("*.json"))  # the target goes when the rank does
