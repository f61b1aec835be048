"""Scenarios run on every rank of a spawned gloo world; each asserts against an independent
single-process reference (the full batch on an unwrapped copy of the model) and returns the
rank's reports for the parent to compare across ranks."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from support.models import TINY, TINY_BLOCKS, TinyGPT, random_batches
from support.reference import (
    OutputRecorder,
    assert_activations,
    assert_close,
    ref_grad_norms,
    ref_update_ratios,
    snapshot,
)
from support.world import wrap
from torch.nn.parallel import DistributedDataParallel as DDP

import torchvitals

GLOBAL_FIELDS = (
    "step",
    "loss",
    "grad_norm",
    "grad_norm_total",
    "update_ratio",
    "update_ratio_step",
    "activations",
    "nonfinite",
    "nonfinite_loss",
    "nonfinite_grad",
    "action",
    "mean_step_seconds",
    "world_size",
    "verdicts",
    "clip_coef",
)


def _count_all_reduce(counter: list[int]):
    real = dist.all_reduce

    def counting(*args, **kwargs):
        counter[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def exact(rank: int, world: int, kind: str, steps: int, config: dict) -> list[dict]:
    """Train ``steps`` steps under DDP or FSDP2 and check every signal against the reference."""
    dims = dict(TINY, vocab=65) if kind == "fsdp" else TINY  # 65: uneven FSDP2 shards
    torch.manual_seed(0)
    model = TinyGPT(**dims)
    reference = copy.deepcopy(model)
    wrapped = wrap(kind, model, world)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    agent = torchvitals.watch(wrapped, opt, sample_every=2, **config)
    assert agent.block_names == TINY_BLOCKS
    calls = [0]
    _count_all_reduce(calls)
    blocks = TINY_BLOCKS[:-1]
    reports, expected_update = [], None
    per = 4
    for step, (x, y) in enumerate(
        random_batches(steps, batch=per * world, seq_len=dims["seq_len"], vocab=dims["vocab"]),
        start=1,
    ):
        sampled = agent.sampled(step)
        recorder = OutputRecorder(reference, blocks) if sampled else None
        ref_loss = reference.loss(x, y)
        ref_loss.backward()
        norms, total = ref_grad_norms(reference, blocks)
        mine = slice(rank * per, (rank + 1) * per)
        loss = lm_loss(wrapped, x[mine], y[mine])
        loss.backward()
        before_calls = calls[0]
        report = agent.step(loss)
        assert calls[0] - before_calls == (2 if sampled else 1), "collectives per step"
        # DDP replicas are compared on sampled steps (riding the MAX vector); FSDP2 has none.
        assert (
            report.replicas.checked == (kind == "ddp" and sampled) and not report.replicas.mismatch
        )
        assert_close(report.loss, ref_loss.item(), what="loss")
        for block, value in norms.items():
            assert_close(
                report.grad_norm[block], value, what=f"{kind} step {step} grad_norm[{block}]"
            )
        assert_close(report.grad_norm_total, total, what=f"{kind} total")
        if sampled:
            stats = recorder.stats()
            recorder.close()
            for block in blocks:
                assert_activations(
                    report.activations[block], stats[block], f"{kind} {step} {block}"
                )
        if report.update_ratio:
            assert set(report.update_ratio) == set(expected_update)
            for block, value in expected_update.items():
                assert_close(
                    report.update_ratio[block], value, what=f"{kind} update_ratio[{block}]"
                )
        before = snapshot(reference)
        ref_opt.step()
        expected_update = ref_update_ratios(before, snapshot(reference), blocks)
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        reports.append({k: v for k, v in report.to_dict().items() if k in GLOBAL_FIELDS})
    assert sum(1 for r in reports if r["update_ratio"]) >= 2
    agent.close()
    return reports


def nonfinite_on_one_rank(rank: int, world: int, kind: str, where: str, config: dict) -> list[dict]:
    """Rank 1 alone gets a NaN (in its loss, or an Inf in one gradient) at step 3."""
    torch.manual_seed(0)
    model = wrap(kind, TinyGPT(**TINY), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    agent = torchvitals.watch(model, opt, sample_every=2, **config)
    out = []
    for step, (x, y) in enumerate(random_batches(5, batch=4, seq_len=16, vocab=64, seed=rank), 1):
        loss = lm_loss(model, x, y)
        if rank == 1 and step == 3 and where == "loss":
            loss = loss * float("nan")
        loss.backward()
        if rank == 1 and step == 3 and where == "grad":
            # After the gradient reduction: only rank 1's (local shard of the) gradient is bad.
            g = next(p.grad for p in model.parameters() if p.grad is not None)
            g = g.to_local() if hasattr(g, "to_local") else g
            g.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        adam_steps = [s.get("step", torch.tensor(0.0)).item() for s in opt.state.values()]
        report = agent.step(loss)
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        after_steps = [s.get("step", torch.tensor(0.0)).item() for s in opt.state.values()]
        opt.zero_grad(set_to_none=True)
        out.append(
            {
                "step": step,
                "nonfinite": report.nonfinite,
                "action": report.action,
                "loss": report.to_dict()["loss"],
                "changed": changed,
                "optimizer_stepped": after_steps != adam_steps or not adam_steps,
            }
        )
    agent.close()
    return out


def serve_metrics(rank: int, world: int, base_port: int) -> dict:
    """Each rank serves /metrics on base + LOCAL_RANK; return what its own endpoint shows."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    torch.manual_seed(0)
    model = DDP(TinyGPT(**TINY))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = torchvitals.watch(model, opt, metrics_port=base_port)
    compute = 0.0
    for x, y in random_batches(3, batch=4, seq_len=16, vocab=64, seed=rank):
        loss = lm_loss(model, x, y)
        loss.backward()
        report = agent.step(loss, samples=4)
        compute += report.timing.compute_seconds
        opt.zero_grad()
    url = agent.metrics_url
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    agent.close()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return {
        "url": url,
        "names": sorted({s.name for s in samples}),
        "ranks": sorted({s.labels.get("rank") for s in samples}),
        "local_loss": next(s.value for s in samples if s.name == "torchvitals_local_loss"),
        "report_local_loss": report.local.loss,
        "loss": report.loss,
        "compute": next(
            s.value for s in samples if s.name == "torchvitals_compute_duration_seconds_sum"
        ),
        "report_compute": compute,
    }
