"""The collector's webhook over real HTTP: a real server on 127.0.0.1, real requests, no mocks.

python -m pytest tests/integration/test_collector_webhook.py
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from contextlib import contextmanager

import pytest
from prometheus_client.parser import text_string_to_metric_families

from torchvitals.collector import CollectorConfig, CollectorServer

TOKEN = "s3cret-token"
"""Alertmanager's (the webhook token): it posts alerts."""
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JOB_TOKENS = {"train-a": "job-a-token-0123", "train-b": "job-b-token-4567"}
"""Each job's own token: it reads and acknowledges that job's directives."""


def job_auth(job="train-a"):
    return {"Authorization": f"Bearer {JOB_TOKENS[job]}"}


def alert(status="firing", fingerprint="fp1", starts_at="2026-11-29T10:00:00.123456789Z", **labels):
    labels = {"alertname": "TorchvitalsLossSpike", **labels}
    return {
        "status": status,
        "labels": labels,
        "annotations": {},
        "startsAt": starts_at,
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "",
        "fingerprint": fingerprint,
    }


def notification(*alerts, status="firing"):
    return {
        "version": "4",
        "groupKey": '{}:{alertname="TorchvitalsLossSpike"}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "torchvitals",
        "groupLabels": {},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "",
        "alerts": list(alerts),
    }


ROLLBACK = alert(job="train-a", torchvitals_action="rollback")


@contextmanager
def running(state_dir, clock=time.time, **settings):
    server = CollectorServer(
        CollectorConfig(
            **{
                "port": 0,
                "state_dir": str(state_dir),
                "webhook_token": TOKEN,
                "job_tokens": json.dumps(JOB_TOKENS),
                "max_body_bytes": 64 * 1024,
                "access_log": False,
                **settings,
            }
        ),
        clock=clock,
    ).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def collector(tmp_path):
    with running(tmp_path / "state") as server:
        yield server


def request(server, method, path, body=None, headers=AUTH):
    """One request on a fresh connection; returns (status, parsed JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(
            method, path, body=data, headers={"Content-Type": "application/json", **headers}
        )
        resp = conn.getresponse()
        text = resp.read().decode()
        ctype = resp.getheader("Content-Type", "")
        return resp.status, json.loads(text) if ctype.startswith("application/json") else text
    finally:
        conn.close()


def pending(server, job="train-a"):
    status, body = request(server, "GET", f"/directives?job={job}", headers=job_auth(job))
    assert status == 200
    return body["directives"]


def metrics(server):
    status, text = request(server, "GET", "/metrics", headers={})
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wr0ng-guess"},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
    ],
)
def test_missing_or_wrong_token_is_401_and_issues_nothing(collector, headers, caplog):
    caplog.set_level("DEBUG")
    status, body = request(collector, "POST", "/alerts", notification(ROLLBACK), headers=headers)
    assert status == 401 and body["error"] == "unauthorized"
    assert pending(collector) == []
    assert request(collector, "GET", "/directives?job=train-a", headers=headers)[0] == 401
    assert "webhook rejected (401 unauthorized)" in caplog.text
    assert TOKEN not in caplog.text and "wr0ng-guess" not in caplog.text


@pytest.mark.parametrize(
    "body, reason, words",
    [
        (b"{not json", "invalid_json", "not JSON"),
        ({**notification(ROLLBACK), "version": "3"}, "unsupported_version", "'3'"),
        (
            {k: v for k, v in notification(ROLLBACK).items() if k != "groupKey"},
            "missing_field",
            "groupKey",
        ),
        (
            notification({k: v for k, v in ROLLBACK.items() if k != "fingerprint"}),
            "missing_field",
            "alerts[0]: missing field 'fingerprint'",
        ),
        (
            notification({k: v for k, v in ROLLBACK.items() if k != "startsAt"}),
            "missing_field",
            "startsAt",
        ),
        (notification({**ROLLBACK, "status": "pending"}), "invalid_field", "status"),
        (notification({**ROLLBACK, "labels": {"job": 3}}), "invalid_field", "labels"),
        (notification({**ROLLBACK, "startsAt": "yesterday"}), "invalid_field", "startsAt"),
    ],
)
def test_invalid_payload_is_400_with_the_reason(collector, body, reason, words):
    status, answer = request(collector, "POST", "/alerts", body)
    assert status == 400
    assert answer["error"] == reason and words in answer["message"]
    assert pending(collector) == []


@pytest.mark.parametrize(
    "starts_at",
    [
        "2026-12-01T10:00:00.123456789Z",
        "2026-12-01T11:00:00.123456789+01:00",
        "2026-12-01T10:00:00Z",
    ],
)
def test_alertmanagers_own_times_are_accepted_on_every_python(collector, starts_at):
    """Go's RFC3339Nano, as Alertmanager sends it: nanoseconds and ``Z`` (or an offset). On
    Python 3.10 ``datetime.fromisoformat`` refused both, so .ci/run runs this file on the
    lowest Python the project claims."""
    order = {
        **ROLLBACK,
        "startsAt": starts_at,
        "endsAt": "0001-01-01T00:00:00Z",
    }  # Go's zero time: still firing
    status, body = request(collector, "POST", "/alerts", notification(order))
    assert status == 200 and body["outcomes"] == {"issued": 1}, body
    [d] = pending(collector)
    assert d["starts_at"] == starts_at  # verbatim: the id of an HA duplicate matches


def test_oversized_body_is_413_before_it_is_read(collector):
    sock = socket.create_connection(("127.0.0.1", collector.port), timeout=5)
    try:
        start = time.monotonic()
        # Declare 10 MB, send 1 KB: an answer proves the server did not wait for the rest.
        sock.sendall(
            b"POST /alerts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {10 * 2**20}\r\n\r\n".encode()
            + b"[" * 1024
        )
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            assert chunk, "connection closed without an answer"
            reply += chunk
        elapsed = time.monotonic() - start
    finally:
        sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    assert elapsed < 2.0
    assert (
        metrics(collector)[
            ("torchvitals_collector_webhooks_rejected_total", (("reason", "body_too_large"),))
        ]
        == 1
    )


def test_same_alert_twice_yields_one_directive(collector):
    first = request(collector, "POST", "/alerts", notification(ROLLBACK))
    again = request(collector, "POST", "/alerts", notification(ROLLBACK))
    assert first[0] == again[0] == 200
    assert first[1]["outcomes"] == {"issued": 1} and len(first[1]["issued"]) == 1
    assert again[1]["outcomes"] == {"duplicate": 1} and again[1]["issued"] == []
    [d] = pending(collector)
    assert (d["id"], d["job"], d["action"]) == (first[1]["issued"][0], "train-a", "rollback")
    assert pending(collector, "train-b") == []


def test_a_new_firing_of_the_same_alert_is_a_new_directive(collector):
    request(collector, "POST", "/alerts", notification(ROLLBACK))
    later = {**ROLLBACK, "startsAt": "2026-11-29T11:00:00Z"}
    assert request(collector, "POST", "/alerts", notification(later))[1]["outcomes"] == {
        "issued": 1
    }
    assert len(pending(collector)) == 2


def test_resolved_alert_does_not_act(collector):
    resolved = {**ROLLBACK, "status": "resolved", "endsAt": "2026-11-29T10:05:00Z"}
    status, body = request(collector, "POST", "/alerts", notification(resolved, status="resolved"))
    assert status == 200 and body["outcomes"] == {"resolved": 1} and body["issued"] == []
    assert pending(collector) == []


def test_alert_without_an_action_is_recorded_not_acted_on(collector):
    plain = alert(job="train-a", severity="warning", fingerprint="fp2")
    unknown = alert(job="train-a", torchvitals_action="reboot", fingerprint="fp3")
    no_job = alert(torchvitals_action="abort", fingerprint="fp4")
    status, body = request(collector, "POST", "/alerts", notification(plain, unknown, no_job))
    assert status == 200 and body["outcomes"] == {"recorded": 3} and body["issued"] == []
    assert pending(collector) == []
    m = metrics(collector)
    assert m[("torchvitals_collector_alerts_total", (("outcome", "recorded"),))] == 3
    assert m[("torchvitals_collector_webhooks_accepted_total", ())] == 1


def test_ack_works_once(collector):
    [directive_id] = request(collector, "POST", "/alerts", notification(ROLLBACK))[1]["issued"]
    status, body = request(collector, "POST", f"/directives/{directive_id}/ack", headers=job_auth())
    assert status == 200 and body["acknowledged"] is True
    assert body["directive"]["acknowledged_at"] is not None
    status, again = request(
        collector, "POST", f"/directives/{directive_id}/ack", headers=job_auth()
    )
    assert status == 200 and again["acknowledged"] is False
    assert again["directive"]["acknowledged_at"] == body["directive"]["acknowledged_at"]
    assert pending(collector) == []
    assert (
        request(collector, "POST", "/directives/0123456789abcdef/ack", headers=job_auth())[0] == 404
    )
    assert request(collector, "POST", f"/directives/{directive_id}/ack", headers={})[0] == 401
    m = metrics(collector)
    assert (
        m[("torchvitals_collector_directives_acknowledged_total", (("action", "rollback"),))] == 1
    )


def test_restart_on_the_same_state_dir_keeps_issued_and_acknowledged(tmp_path):
    abort = alert(job="train-a", torchvitals_action="abort", fingerprint="fp9")
    with running(tmp_path / "state") as server:
        [acked] = request(server, "POST", "/alerts", notification(ROLLBACK))[1]["issued"]
        [kept] = request(server, "POST", "/alerts", notification(abort))[1]["issued"]
        assert request(server, "POST", f"/directives/{acked}/ack", headers=job_auth())[0] == 200
    with running(tmp_path / "state") as server:
        assert [d["id"] for d in pending(server)] == [kept]
        # Alertmanager repeats a still-firing alert: neither directive is issued again.
        outcomes = request(server, "POST", "/alerts", notification(ROLLBACK, abort))[1]
        assert outcomes == {"outcomes": {"duplicate": 2}, "issued": []}
        assert (
            request(server, "POST", f"/directives/{acked}/ack", headers=job_auth())[1][
                "acknowledged"
            ]
            is False
        )
        assert request(server, "GET", "/healthz", headers={})[1] == {
            "status": "ok",
            "directives": {"pending": 1, "acknowledged": 1},
        }
        m = metrics(server)
        assert m[("torchvitals_collector_directives", (("state", "pending"),))] == 1
        assert m[("torchvitals_collector_directives", (("state", "acknowledged"),))] == 1


def test_metrics_count_rejections_by_reason(collector):
    request(collector, "POST", "/alerts", notification(ROLLBACK), headers={})
    request(
        collector,
        "POST",
        "/alerts",
        notification(ROLLBACK),
        headers={"Authorization": "Bearer nope"},
    )
    request(collector, "POST", "/alerts", b"]")
    request(collector, "POST", "/alerts", {**notification(ROLLBACK), "version": "5"})
    request(collector, "POST", "/alerts", notification(ROLLBACK))
    m = metrics(collector)
    rejected = {
        dict(labels)["reason"]: value
        for (name, labels), value in m.items()
        if name == "torchvitals_collector_webhooks_rejected_total"
    }
    assert rejected == {
        "unauthorized": 2,
        "invalid_json": 1,
        "unsupported_version": 1,
        "body_too_large": 0,
        "missing_field": 0,
        "invalid_field": 0,
    }
    assert m[("torchvitals_collector_webhooks_accepted_total", ())] == 1
    assert m[("torchvitals_collector_directives_issued_total", (("action", "rollback"),))] == 1
    assert m[("torchvitals_collector_alerts_total", (("outcome", "issued"),))] == 1
    families = [
        f
        for f in text_string_to_metric_families(
            request(collector, "GET", "/metrics", headers={})[1]
        )
    ]
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family exposed twice"
    for family in families:
        assert re.match(r"^torchvitals_collector_[a-z][a-z0-9_]*$", family.name), family.name
        assert family.type in ("counter", "gauge") and family.documentation, family.name
        if family.type == "counter":
            assert {s.name for s in family.samples} <= {
                family.name + "_total",
                family.name + "_created",
            }
