"""A suspect step computed once more (``agent.step(loss, closure=fn)``), in one process: a
fault that does not come back is a transient one, its update dropped; a bad batch reproduces;
without an outlier the closure is never called."""

from __future__ import annotations

import torch
from support.models import TINY, TinyGPT, random_batches

import torchvitals

BATCHES = list(random_batches(60, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=1))


def _run(tmp_path, fault_at: int, transient: bool, closure: bool = True):
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    agent = torchvitals.watch(model, opt, checkpoint_dir=str(tmp_path), metrics_port=0, log_dir="")
    calls, reports, moved = [], [], {}
    try:
        for step, (x, y) in enumerate(BATCHES[:40], start=1):
            scale = 1e3 if step == fault_at else 1.0

            def loss_of(scale: float = scale, x=x, y=y) -> torch.Tensor:
                logits = model(x) * scale
                return torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
                )

            def again(step: int = step, scale: float = scale) -> torch.Tensor:
                calls.append(step)
                loss = loss_of(1.0 if transient else scale)
                loss.backward()
                return loss

            loss = loss_of()
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            reports.append(agent.step(loss, closure=again if closure else None))
            moved[step] = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            opt.zero_grad(set_to_none=True)
    finally:
        agent.close()
    return reports, calls, moved


def test_a_fault_that_does_not_come_back_is_transient_and_its_update_dropped(tmp_path):
    reports, calls, moved = _run(tmp_path, fault_at=30, transient=True)
    assert calls == [30], "computed again at the outlier step only"
    at = reports[29]
    assert [v.pattern for v in at.verdicts] == ["loss_outlier", "transient_fault"]
    assert at.action == "skip" and at.remedy == "rerun" and not moved[30]
    assert at.rerun is not None and not at.rerun.reproduced and at.rerun.ranks == [0]
    assert at.rerun.loss < at.verdicts[0].evidence["threshold"] < at.loss
    assert at.rerun.seconds > 0 and at.to_dict()["rerun"]["reproduced"] is False
    assert all(r.action == "step" for r in reports[30:]), "the next steps train on"


def test_a_fault_that_comes_back_is_no_transient_and_still_skipped(tmp_path):
    reports, calls, moved = _run(tmp_path, fault_at=30, transient=False)
    at = reports[29]
    assert calls == [30] and at.rerun is not None and at.rerun.reproduced
    assert [v.pattern for v in at.verdicts] == ["loss_outlier"]
    assert at.action == "skip" and at.remedy == "skip_update" and not moved[30]


def test_without_an_outlier_the_closure_is_never_called_and_without_one_nothing_reruns(
    tmp_path,
):
    _, calls, _ = _run(tmp_path / "a", fault_at=0, transient=True)
    assert calls == []
    reports, calls, _ = _run(tmp_path / "b", fault_at=30, transient=True, closure=False)
    assert calls == [] and reports[29].rerun is None and reports[29].remedy == "skip_update"
