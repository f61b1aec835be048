"""A directive posted to the collector's webhook reaches a running 2-rank job: both ranks roll
back in the same step, and the directive is acknowledged once."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from directive_ranks import obedient_job
from support.world import run_world

from torchvitals.collector import CollectorConfig, CollectorServer

TOKEN = "job-token-123"
"""The job's own token (its ranks hold it); Alertmanager posts with ``WEBHOOK_TOKEN``."""
WEBHOOK_TOKEN = "alertmanager-token-456"


def collector_config(state_dir) -> CollectorConfig:
    return CollectorConfig(
        port=0,
        state_dir=str(state_dir),
        webhook_token=WEBHOOK_TOKEN,
        job_tokens=json.dumps({"train-a": TOKEN}),
        access_log=False,
    )


def post(
    url: str, path: str, body: dict | None = None, method: str = "POST", token: str = TOKEN
) -> dict:
    req = urllib.request.Request(
        url + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read().decode())


def rollback_alert() -> dict:
    return {
        "version": "4",
        "groupKey": '{}:{alertname="TorchvitalsLossSpike"}',
        "status": "firing",
        "receiver": "torchvitals",
        "groupLabels": {},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "",
        "truncatedAlerts": 0,
        "alerts": [
            {
                "status": "firing",
                "fingerprint": "abc123",
                "startsAt": "2026-11-29T10:00:00Z",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "",
                "annotations": {},
                "labels": {
                    "alertname": "TorchvitalsLossSpike",
                    "job": "train-a",
                    "torchvitals_action": "rollback",
                },
            }
        ],
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_rollback_directive_rolls_both_ranks_back_in_the_same_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHVITALS_WEBHOOK_TOKEN", TOKEN)  # the ranks inherit it
    server = CollectorServer(collector_config(tmp_path / "state")).start()
    url = f"http://127.0.0.1:{server.port}"
    marker = tmp_path / "at-step-25"
    posted: list[float] = []

    def post_when_ready() -> None:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        posted.append(time.time())
        post(url, "/alerts", rollback_alert(), token=WEBHOOK_TOKEN)

    poster = threading.Thread(target=post_when_ready, daemon=True)
    poster.start()
    try:
        rank0, rank1 = run_world(obedient_job, url, str(tmp_path / "ckpt"), str(marker), 60)
        poster.join(5)
        pending = post(url, "/directives?job=train-a", method="GET")["directives"]
        health = post(url, "/healthz", method="GET")
    finally:
        server.stop()
    steps = [[(r["step"], r["action"]) for r in rank["reports"]] for rank in (rank0, rank1)]
    assert steps[0] == steps[1], "the ranks took different actions"
    rollbacks = [r for r in rank0["reports"] if r["action"] == "rollback"]
    assert len(rollbacks) == 1, steps[0]
    rb = rollbacks[0]
    assert "collector_directive" in rb["verdicts"] and rb["rollback"]["to_step"] == 20
    # Posted after step 25; polled every 0.05 s against 0.02 s+ steps: acted on within a few steps.
    assert rb["time"] >= posted[0] and rb["step"] - 25 <= 15, (rb["step"], posted)
    assert pending == [] and health["directives"] == {"pending": 0, "acknowledged": 1}


def test_a_collector_that_is_down_is_counted_not_a_training_failure(caplog):
    import torch
    from support.models import TINY, TinyGPT, random_batches
    from support.world import free_port

    import torchvitals

    model = TinyGPT(**TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = torchvitals.watch(
        model, opt, collector_url=f"http://127.0.0.1:{free_port()}", collector_poll_seconds=0.02
    )
    for x, y in random_batches(10, batch=2, seq_len=TINY["seq_len"], vocab=TINY["vocab"]):
        loss = model.loss(x, y)
        loss.backward()
        assert agent.step(loss).action == "step"
        opt.zero_grad()
        time.sleep(0.02)
    agent.close()
    assert agent._poller.failures > 0
    down = [r for r in caplog.records if "cannot poll directives" in r.getMessage()]
    assert len(down) == 1, "an outage is logged once, not once per poll"


def test_the_job_reads_its_token_from_a_mounted_secret_file(tmp_path, monkeypatch):
    import torch
    from support.models import TINY, TinyGPT, random_batches

    import torchvitals

    (tmp_path / "token").write_text(TOKEN + "\n")  # as a Kubernetes secret mounts it
    monkeypatch.delenv("TORCHVITALS_WEBHOOK_TOKEN", raising=False)
    monkeypatch.setenv("TORCHVITALS_WEBHOOK_TOKEN_FILE", str(tmp_path / "token"))
    server = CollectorServer(collector_config(tmp_path / "state")).start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        post(url, "/alerts", rollback_alert(), token=WEBHOOK_TOKEN)
        model = TinyGPT(**TINY)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        agent = torchvitals.watch(
            model, opt, collector_url=url, collector_job="train-a", collector_poll_seconds=0.02
        )
        taken = []
        for x, y in random_batches(100, batch=2, seq_len=TINY["seq_len"], vocab=TINY["vocab"]):
            loss = model.loss(x, y)
            loss.backward()
            taken += [v for v in agent.step(loss).verdicts if v.pattern == "collector_directive"]
            opt.zero_grad()
            if taken:
                break
            time.sleep(0.02)
        agent.close()
        assert [v.evidence["action"] for v in taken] == ["rollback"]
        assert agent._poller.failures == 0, "the token from the file was accepted"
    finally:
        server.stop()


def test_an_unreadable_token_file_is_a_clear_error_at_watch(tmp_path, monkeypatch):
    import pytest
    import torch

    import torchvitals

    monkeypatch.delenv("TORCHVITALS_WEBHOOK_TOKEN", raising=False)
    monkeypatch.setenv("TORCHVITALS_WEBHOOK_TOKEN_FILE", str(tmp_path / "missing"))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="TORCHVITALS_WEBHOOK_TOKEN_FILE: cannot read"):
        torchvitals.watch(
            model, torch.optim.SGD(model.parameters(), lr=0.1), collector_url="http://127.0.0.1:9"
        )
