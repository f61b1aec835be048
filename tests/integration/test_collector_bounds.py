"""The collector's state stays bounded: label and job caps, pruning, expiry, runs, flat posts.

    python -m pytest tests/integration/test_collector_bounds.py

A real collector on 127.0.0.1, real HTTP requests; a post's cost is counted in SQLite's
instructions, never timed.
"""

from __future__ import annotations

import json

from test_collector_webhook import (
    JOB_TOKENS,
    ROLLBACK,
    alert,
    job_auth,
    metrics,
    notification,
    request,
    running,
)

BIG_BODY = 8 * 2**20


def poll(server, job="train-a", run=None):
    path = f"/directives?job={job}" + (f"&run={run}" if run else "")
    status, body = request(server, "GET", path, headers=job_auth(job))
    assert status == 200, body
    return [d["id"] for d in body["directives"]]


def health(server):
    return request(server, "GET", "/healthz", headers={})[1]["directives"]


def gauge(server, state):
    return metrics(server)[("torchvitals_collector_directives", (("state", state),))]


def orders(jobs, tag=""):
    return [
        alert(job=job, torchvitals_action="rollback", fingerprint=f"fp-{tag}{job}") for job in jobs
    ]


def test_ten_thousand_jobs_stay_within_max_jobs_and_nothing_stored_is_lost(tmp_path):
    with running(tmp_path / "state", max_jobs=1000, max_body_bytes=BIG_BODY) as server:
        jobs = [f"job-{i:05d}" for i in range(10_000)]
        # All at once: refused whole, nothing stored.
        status, body = request(server, "POST", "/alerts", notification(*orders(jobs)))
        assert status == 507 and body["error"] == "too_many_jobs"
        assert "max_jobs" in body["message"] and "1000" in body["message"]
        assert health(server) == {"pending": 0, "acknowledged": 0}
        accepted = refused = 0
        for start in range(0, len(jobs), 500):
            status, body = request(
                server, "POST", "/alerts", notification(*orders(jobs[start : start + 500]))
            )
            if status == 200:
                accepted += len(body["issued"])
            else:
                assert (status, body["error"]) == (507, "too_many_jobs"), body
                refused += 1
        assert accepted == 1000 and refused == 18
        assert health(server) == {"pending": 1000, "acknowledged": 0}
        assert metrics(server)[("torchvitals_collector_jobs", ())] == 1000
        # A job already stored still takes new orders; the store holds no more than its cap.
        status, body = request(
            server, "POST", "/alerts", notification(*orders(["job-00001"], tag="again-"))
        )
        assert status == 200 and body["outcomes"] == {"issued": 1}
        assert (
            metrics(server)[
                ("torchvitals_collector_webhooks_rejected_total", (("reason", "too_many_jobs"),))
            ]
            == 19
        )
    assert sum(p.stat().st_size for p in (tmp_path / "state").iterdir()) < 8 * 2**20


def test_directives_per_job_are_capped_and_closed_ones_make_room(tmp_path):
    with running(tmp_path / "state", max_directives_per_job=3) as server:
        ids = [
            request(
                server,
                "POST",
                "/alerts",
                notification(
                    alert(job="train-a", torchvitals_action="rollback", fingerprint=f"fp{i}")
                ),
            )[1]["issued"][0]
            for i in range(3)
        ]
        status, body = request(
            server,
            "POST",
            "/alerts",
            notification(alert(job="train-a", torchvitals_action="rollback", fingerprint="fp3")),
        )
        assert status == 507 and body["error"] == "too_many_directives"
        assert "max_directives_per_job" in body["message"]
        assert poll(server) == ids
        assert request(server, "POST", f"/directives/{ids[0]}/ack", headers=job_auth())[0] == 200
        status, body = request(
            server,
            "POST",
            "/alerts",
            notification(alert(job="train-a", torchvitals_action="rollback", fingerprint="fp3")),
        )
        assert status == 200 and body["outcomes"] == {"issued": 1}
        assert len(poll(server)) == 3


def test_one_megabyte_labels_are_refused_naming_the_label(tmp_path):
    with running(tmp_path / "state", max_body_bytes=BIG_BODY) as server:
        huge = "x" * 2**20
        for labels, words in [
            ({"description": huge}, "alerts[0]: label 'description'"),
            ({"job": huge}, "alerts[0]: label 'job'"),
            ({huge: "v"}, "alerts[0]: a label name"),
            ({f"l{i}": "v" for i in range(65)}, "labels, over the limit of 64"),
        ]:
            status, body = request(
                server,
                "POST",
                "/alerts",
                notification({**ROLLBACK, "labels": {**ROLLBACK["labels"], **labels}}),
            )
            assert status == 400 and body["error"] == "label_too_large", body
            assert words in body["message"], body["message"]
            assert len(body["message"]) < 300, "the answer does not echo the label"
        eight = notification(
            *[
                {
                    **alert(job="train-a", torchvitals_action="rollback", fingerprint=f"fp{i}"),
                    "labels": {
                        "job": "train-a",
                        "torchvitals_action": "rollback",
                        "big": "y" * 10**6,
                    },
                }
                for i in range(8)
            ]
        )
        status, body = request(server, "POST", "/alerts", eight)
        assert status == 400 and "max_label_bytes" in body["message"]
        assert health(server) == {"pending": 0, "acknowledged": 0}
    assert sum(p.stat().st_size for p in (tmp_path / "state").iterdir()) < 2**20


def _post_work(server, job_of, tag, n=10):
    """The SQLite virtual-machine instructions each of ``n`` posts runs, counted by a progress
    handler on the store's connection: the work a post does, which no busy neighbour changes."""
    counts = []
    ran = [0]

    def count() -> int:
        ran[0] += 1
        return 0  # go on

    for i in range(n):
        ran[0] = 0
        server.store._db.set_progress_handler(count, 1)
        try:
            body = notification(
                alert(job=job_of(i), torchvitals_action="rollback", fingerprint=f"{tag}-{i}")
            )
            status, answer = request(server, "POST", "/alerts", body)
        finally:
            server.store._db.set_progress_handler(None, 1)
        assert status == 200 and answer["outcomes"] == {"issued": 1}
        counts.append(ran[0])
    return counts


def test_a_post_does_the_same_work_however_large_the_state(tmp_path):
    with running(tmp_path / "state", max_jobs=20_000, max_body_bytes=BIG_BODY) as server:
        request(server, "POST", "/alerts", notification(*orders([f"few-{i}" for i in range(10)])))
        small = _post_work(server, lambda i: f"few-{i % 10}", "small")
        for start in range(0, 10_000, 2500):
            status, _ = request(
                server,
                "POST",
                "/alerts",
                notification(*orders([f"many-{i}" for i in range(start, start + 2500)])),
            )
            assert status == 200
        assert metrics(server)[("torchvitals_collector_jobs", ())] == 10_010
        large = _post_work(server, lambda i: f"many-{i * 397 % 10_000}", "large")
    # Indexed lookups: ~175 instructions a post at 10 jobs as at 10,010. A scan of the jobs or
    # the directives table would run at least one instruction per row (10,000 more).
    assert max(large) <= 1.5 * max(small), (small, large)


class FakeClock:
    """The store's clock, moved by the test: time passes without sleeping."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_acknowledged_directives_are_pruned_after_retention_or_resolution(tmp_path):
    clock = FakeClock()
    with running(tmp_path / "state", clock, retention_seconds=600) as server:
        [first] = request(server, "POST", "/alerts", notification(ROLLBACK))[1]["issued"]
        assert request(server, "POST", f"/directives/{first}/ack", headers=job_auth())[0] == 200
        clock.now += 599
        # Within retention a repeat of the still-firing alert orders nothing.
        assert request(server, "POST", "/alerts", notification(ROLLBACK))[1]["outcomes"] == {
            "duplicate": 1
        }
        assert health(server)["acknowledged"] == 1
        clock.now += 2
        request(server, "POST", "/alerts", notification(alert(severity="info")))  # any write
        assert health(server) == {"pending": 0, "acknowledged": 0}
        assert request(server, "POST", f"/directives/{first}/ack", headers=job_auth())[0] == 404
    with running(tmp_path / "other") as server:
        [second] = request(server, "POST", "/alerts", notification(ROLLBACK))[1]["issued"]
        request(server, "POST", f"/directives/{second}/ack", headers=job_auth())
        resolved = {**ROLLBACK, "status": "resolved", "endsAt": "2026-11-29T10:05:00Z"}
        assert request(server, "POST", "/alerts", notification(resolved, status="resolved"))[1][
            "outcomes"
        ] == {"resolved": 1}
        assert health(server) == {"pending": 0, "acknowledged": 0}


def test_a_pending_directive_expires_and_its_repeat_orders_nothing(tmp_path):
    clock = FakeClock()
    with running(tmp_path / "state", clock, directive_ttl_seconds=60) as server:
        [d] = request(server, "POST", "/alerts", notification(ROLLBACK))[1]["issued"]
        clock.now += 59
        assert poll(server, run="run-1") == [d]
        clock.now += 2
        assert poll(server, run="run-1") == []
        assert health(server) == {"pending": 0, "acknowledged": 0}
        assert gauge(server, "expired") == 1
        assert request(server, "POST", "/alerts", notification(ROLLBACK))[1]["outcomes"] == {
            "duplicate": 1
        }
        assert poll(server, run="run-1") == []
        assert gauge(server, "expired") == 1


def test_a_new_run_of_the_same_job_name_does_not_inherit_an_old_order(tmp_path):
    with running(tmp_path / "state") as server:
        assert poll(server, run="run-1") == []
        [old] = request(server, "POST", "/alerts", notification(ROLLBACK))[1]["issued"]
        assert poll(server, run="run-1") == [old]
        # The job restarts under the same name: the new run never sees run-1's order.
        assert poll(server, run="run-2") == []
        later = alert(job="train-a", torchvitals_action="abort", fingerprint="fp-new")
        [new] = request(server, "POST", "/alerts", notification(later))[1]["issued"]
        # Bound to the run last seen polling, run-2: delivered to it only.
        assert poll(server, run="run-2") == [new]
        assert poll(server, run="run-1") == [old]
        [d] = request(server, "GET", "/directives?job=train-a&run=run-2", headers=job_auth())[1][
            "directives"
        ]
        assert d["run"] == "run-2"


def test_an_order_issued_before_any_run_polled_goes_to_the_first_run_only(tmp_path):
    with running(tmp_path / "state") as server:
        [d] = request(server, "POST", "/alerts", notification(ROLLBACK))[1]["issued"]
        assert poll(server, run="run-1") == [d]
        assert poll(server, run="run-2") == []
        assert poll(server, run="run-1") == [d]


def test_runs_and_directives_survive_a_restart(tmp_path):
    with running(tmp_path / "state") as server:
        poll(server, run="run-1")
        [d] = request(server, "POST", "/alerts", notification(ROLLBACK))[1]["issued"]
    with running(tmp_path / "state") as server:
        assert poll(server, run="run-2") == []
        assert poll(server, run="run-1") == [d]


def test_a_malformed_poll_is_400_with_the_reason(tmp_path):
    with running(tmp_path / "state") as server:
        status, body = request(server, "GET", "/directives", headers=job_auth())
        assert status == 400 and body["error"] == "missing_field" and "job" in body["message"]
        status, body = request(
            server, "GET", "/directives?job=train-a&run=" + "r" * 300, headers=job_auth()
        )
        assert status == 400 and body["error"] == "invalid_field" and "run" in body["message"]
        assert JOB_TOKENS["train-a"] not in json.dumps(body)
