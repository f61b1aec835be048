"""Tokens scoped per job: a job's token serves its own directives, Alertmanager's posts alerts.

    python -m pytest tests/integration/test_collector_tokens.py

A real collector on 127.0.0.1, real HTTP requests, the agent's real poller.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

import pytest
from test_collector_webhook import (
    AUTH,
    JOB_TOKENS,
    ROLLBACK,
    TOKEN,
    alert,
    job_auth,
    notification,
    pending,
    request,
    running,
)

from torchvitals.agent.recover.directives import DirectivePoller, run_identity
from torchvitals.collector import CollectorConfig, CollectorServer
from torchvitals.protocol import TokenError

ABORT_B = alert(job="train-b", torchvitals_action="abort", fingerprint="fp-b")


def test_a_token_of_job_a_cannot_poll_ack_or_abort_job_b(collector_with_b):
    server, b_id = collector_with_b
    status, body = request(server, "GET", "/directives?job=train-b", headers=job_auth("train-a"))
    assert status == 403 and body["error"] == "forbidden"
    assert "'train-a'" in body["message"] and "'train-b'" in body["message"]
    status, body = request(server, "POST", f"/directives/{b_id}/ack", headers=job_auth("train-a"))
    assert status == 403 and body["error"] == "forbidden"
    # Nor can it order an abort of B: posting alerts needs Alertmanager's token.
    status, body = request(
        server,
        "POST",
        "/alerts",
        notification({**ABORT_B, "fingerprint": "forged"}),
        headers=job_auth("train-a"),
    )
    assert status == 403 and body["error"] == "forbidden" and "webhook token" in body["message"]
    assert [d["id"] for d in pending(server, "train-b")] == [b_id]
    assert (
        request(server, "POST", f"/directives/{b_id}/ack", headers=job_auth("train-b"))[1][
            "acknowledged"
        ]
        is True
    )


def test_alertmanagers_token_posts_alerts_but_cannot_poll_or_ack(collector_with_b):
    server, b_id = collector_with_b
    status, body = request(server, "GET", "/directives?job=train-b", headers=AUTH)
    assert status == 403 and "post alerts only" in body["message"]
    status, body = request(server, "POST", f"/directives/{b_id}/ack", headers=AUTH)
    assert status == 403 and "post alerts only" in body["message"]
    assert [d["id"] for d in pending(server, "train-b")] == [b_id]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer guess"}, {"Authorization": f"Basic {JOB_TOKENS['train-a']}"}],
)
def test_an_unknown_token_is_401_everywhere(collector_with_b, headers):
    server, b_id = collector_with_b
    for method, path in [
        ("GET", "/directives?job=train-b"),
        ("POST", f"/directives/{b_id}/ack"),
        ("POST", "/alerts"),
    ]:
        status, body = request(
            server,
            method,
            path,
            notification(ROLLBACK) if path == "/alerts" else None,
            headers=headers,
        )
        assert status == 401 and body["error"] == "unauthorized", (method, path)


@pytest.fixture
def collector_with_b(tmp_path):
    with running(tmp_path / "state") as server:
        [b_id] = request(server, "POST", "/alerts", notification(ABORT_B))[1]["issued"]
        yield server, b_id


def test_the_tokens_file_holds_digests_and_is_reread_when_it_changes(tmp_path, caplog):
    path = tmp_path / "job-tokens.json"
    digest = "sha256:" + hashlib.sha256(b"token-of-a-123").hexdigest()
    path.write_text(json.dumps({"train-a": digest}))
    config = CollectorConfig(
        port=0,
        state_dir=str(tmp_path / "state"),
        webhook_token=TOKEN,
        job_tokens_file=str(path),
        access_log=False,
    )
    server = CollectorServer(config).start()
    try:
        a = {"Authorization": "Bearer token-of-a-123"}
        b = {"Authorization": "Bearer token-of-b-456"}
        assert request(server, "GET", "/directives?job=train-a", headers=a)[0] == 200
        assert request(server, "GET", "/directives?job=train-b", headers=b)[0] == 401
        path.write_text(json.dumps({"train-a": digest, "train-b": "token-of-b-456"}))
        assert request(server, "GET", "/directives?job=train-b", headers=b)[0] == 200
        path.write_text("{broken")  # a bad edit keeps the tokens read before
        for _ in range(3):
            assert request(server, "GET", "/directives?job=train-b", headers=b)[0] == 200
        assert caplog.text.count("keeping the 2 job token(s)") == 1, "logged once, not per poll"
        path.unlink()
        assert request(server, "GET", "/directives?job=train-b", headers=b)[0] == 200
        assert caplog.text.count("keeping the 2 job token(s)") == 2
        assert "token-of" not in caplog.text and digest[7:] not in caplog.text
    finally:
        server.stop()


@pytest.mark.parametrize(
    "tokens, words",
    [
        ({"train-a": TOKEN}, "has the webhook token"),
        ({"train-a": "same-token-000", "train-b": "same-token-000"}, "share a token"),
        ({"train-a": ""}, "non-empty token"),
        ({"train-a": "sha256:abc"}, "64 hex digits"),
        (["train-a"], "JSON object"),
    ],
)
def test_unusable_job_tokens_refuse_to_start_without_showing_a_token(tmp_path, tokens, words):
    config = CollectorConfig(
        port=0,
        state_dir=str(tmp_path),
        webhook_token=TOKEN,
        job_tokens=json.dumps(tokens),
        access_log=False,
    )
    with pytest.raises(TokenError, match=words) as exc:
        CollectorServer(config)
    assert TOKEN not in str(exc.value) and "same-token-000" not in str(exc.value)


def test_the_agents_poller_gets_its_own_runs_orders_and_says_why_it_is_refused(tmp_path, caplog):
    with running(tmp_path / "state") as server:
        url = f"http://127.0.0.1:{server.port}"
        first = DirectivePoller(url, "train-a", 0.02, token=JOB_TOKENS["train-a"], run="run-1")
        wrong = DirectivePoller(url, "train-b", 0.02, token=JOB_TOKENS["train-a"], run="x")
        try:
            time.sleep(0.2)  # run-1 has polled: the next order is bound to it
            request(server, "POST", "/alerts", notification(ROLLBACK))
            deadline = time.monotonic() + 10
            while first.code() == 0.0 and time.monotonic() < deadline:
                time.sleep(0.02)
            second = DirectivePoller(url, "train-a", 0.02, token=JOB_TOKENS["train-a"], run="run-2")
            time.sleep(0.3)
            assert second.code() == 0.0, "a new run inherited the old run's order"
            second.close()
            assert first.code() == 1.0
            taken = first.take()
            assert taken["run"] == "run-1"
            deadline = time.monotonic() + 10
            while (
                request(server, "GET", "/healthz", headers={})[1]["directives"]["acknowledged"] == 0
                and time.monotonic() < deadline
            ):
                time.sleep(0.02)
            assert request(server, "GET", "/healthz", headers={})[1]["directives"] == {
                "pending": 0,
                "acknowledged": 1,
            }
        finally:
            first.close()
            wrong.close()
        assert wrong.failures > 0 and wrong.code() == 0.0
        refused = [
            r.getMessage() for r in caplog.records if "cannot poll directives" in r.getMessage()
        ]
        assert len(refused) == 1 and "HTTP 403" in refused[0] and "'train-b'" in refused[0]
        assert JOB_TOKENS["train-a"] not in caplog.text


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"TORCHVITALS_JOB_ID": "tv-1", "TORCHELASTIC_RUN_ID": "te", "SLURM_JOB_ID": "42"}, "tv-1"),
        ({"TORCHELASTIC_RUN_ID": "te", "SLURM_JOB_ID": "42"}, "te"),
        ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "42"}, "42"),
    ],
)
def test_the_run_identity_is_the_first_job_id_set(environ, expected):
    assert run_identity(environ) == expected


def test_without_a_job_id_the_run_identity_is_made_once_per_process():
    made = run_identity({})
    assert made == run_identity({"TORCHELASTIC_RUN_ID": "none"}) and len(made) == 32


def test_a_job_token_is_never_logged(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    with running(tmp_path / "state", access_log=True) as server:
        request(server, "POST", "/alerts", notification(ROLLBACK))
        pending(server)
        request(server, "GET", "/directives?job=train-b", headers=job_auth("train-a"))
    assert all(t not in caplog.text for t in [TOKEN, *JOB_TOKENS.values()])
