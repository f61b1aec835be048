"""The supervisors' etcd client against a real etcd: TLS with client certificates, etcd's
authentication (a token per user, fetched again when it expires), and what a job leaves in the
store: its keys leased while it runs, gone when it ends, each node's step written no more often
than its lease is renewed.

    python -m pytest tests/multinode/test_store.py
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace

import pytest
from cluster import PASSWORDS, PYTHONPATH, Certs, Etcd

from torchvitals.supervisor.etcd import EtcdStore, StoreError, StoreTLS
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.orders import JobEnded, StartAttempt
from torchvitals.supervisor.store_peers import StorePeers, store_of
from torchvitals.supervisor.store_schema import KEY_ROOT
from torchvitals.supervisor.telemetry import SupervisorMetrics

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory, certs):
    with Etcd(tmp_path_factory.mktemp("etcd-tls"), certs=certs) as server:
        yield server


def client_tls(certs: Certs, **changes) -> StoreTLS:
    return replace(
        StoreTLS(
            cafile=str(certs.ca), certfile=str(certs.client_cert), keyfile=str(certs.client_key)
        ),
        **changes,
    )


# ---------------------------------------------------------------- TLS


def test_a_store_with_client_certificates_refuses_a_client_without_the_right_one(tls_etcd, certs):
    url = tls_etcd.url
    with pytest.raises(StoreError, match="set store_cafile"):
        EtcdStore(url, tls=StoreTLS()).get(KEY_ROOT + "x")
    with pytest.raises(StoreError, match="needs store_certfile and store_keyfile"):
        EtcdStore(url, tls=StoreTLS(cafile=str(certs.ca))).get(KEY_ROOT + "x")
    stranger = client_tls(certs, certfile=str(certs.stranger_cert), keyfile=str(certs.stranger_key))
    with pytest.raises(StoreError, match="needs store_certfile and store_keyfile"):
        EtcdStore(url, tls=stranger).get(KEY_ROOT + "x")
    with pytest.raises(StoreError, match=r"use an https:// store_url|TLS handshake"):
        EtcdStore(url.replace("https://", "http://")).get(KEY_ROOT + "x")

    store = EtcdStore(url, tls=client_tls(certs))
    lease = store.grant(5)
    store.put(KEY_ROOT + "tls/k", "v", lease=lease)
    entry = store.get(KEY_ROOT + "tls/k")
    assert (entry.value, entry.lease, entry.version) == ("v", lease, 1)


def test_unreadable_tls_files_are_named_before_any_call(tmp_path, certs):
    with pytest.raises(StoreError, match=r"store_cafile .*nope\.crt"):
        EtcdStore("https://127.0.0.1:1", tls=StoreTLS(cafile=str(tmp_path / "nope.crt")))
    with pytest.raises(StoreError, match=r"store_certfile .* store_keyfile"):
        EtcdStore("https://127.0.0.1:1", tls=client_tls(certs, keyfile=str(certs.ca)))
    with pytest.raises(StoreError, match="needs an https:// store_url"):
        EtcdStore("http://127.0.0.1:1", tls=client_tls(certs))


# ---------------------------------------------------------------- authentication


def test_a_store_with_auth_refuses_a_client_without_the_password(auth_etcd, certs):
    url, tls = auth_etcd.url, client_tls(certs)
    with pytest.raises(StoreError, match="requires authentication: set store_user"):
        EtcdStore(url, tls=tls).get(KEY_ROOT + "x")
    with pytest.raises(StoreError, match="authentication as store_user 'supervisor' failed"):
        EtcdStore(url, tls=tls, user="supervisor", password="wrong").get(KEY_ROOT + "x")
    store = EtcdStore(url, tls=tls, user="supervisor", password=PASSWORDS["supervisor"])
    assert store.create(KEY_ROOT + "auth/k", "v")
    assert store.get(KEY_ROOT + "auth/k").value == "v"
    # The supervisor's user may touch the jobs' prefix only.
    with pytest.raises(StoreError, match="'supervisor' needs read and write permission"):
        store.put("elsewhere", "v")


def test_an_expired_token_is_fetched_again(auth_etcd, certs, caplog):
    store = EtcdStore(
        auth_etcd.url, tls=client_tls(certs), user="supervisor", password=PASSWORDS["supervisor"]
    )
    store.put(KEY_ROOT + "auth/expiry", "1")
    token = store._authenticated()
    time.sleep(3)  # > --auth-token-ttl 1, plus etcd's 1 s sweep
    # The old token is refused now (by etcd itself, not the client)...
    with pytest.raises(OSError):
        auth_etcd.call("/v3/kv/range", {"key": "eA=="}, token=token)
    # ...and the client gets a new one and carries on.
    with caplog.at_level(logging.INFO, logger="torchvitals.supervisor"):
        store.put(KEY_ROOT + "auth/expiry", "2")
    assert store.get(KEY_ROOT + "auth/expiry").value == "2"
    assert "authenticating again" in caplog.text


def test_the_supervisor_config_reaches_the_store_with_a_password_from_a_file(
    auth_etcd, certs, tmp_path
):
    password = tmp_path / "password"
    password.write_text(PASSWORDS["supervisor"] + "\n")
    env = {
        "TORCHVITALS_SUPERVISOR_STORE_URL": auth_etcd.url,
        "TORCHVITALS_SUPERVISOR_STORE_CAFILE": str(certs.ca),
        "TORCHVITALS_SUPERVISOR_STORE_CERTFILE": str(certs.client_cert),
        "TORCHVITALS_SUPERVISOR_STORE_KEYFILE": str(certs.client_key),
        "TORCHVITALS_SUPERVISOR_STORE_USER": "supervisor",
        "TORCHVITALS_SUPERVISOR_STORE_PASSWORD_FILE": str(password),
    }
    store = store_of(SupervisorConfig.from_env(env))
    store.put(KEY_ROOT + "auth/config", "ok")
    env.pop("TORCHVITALS_SUPERVISOR_STORE_PASSWORD_FILE")
    env["TORCHVITALS_SUPERVISOR_STORE_PASSWORD"] = PASSWORDS["supervisor"]
    assert store_of(SupervisorConfig.from_env(env)).get(KEY_ROOT + "auth/config").value == "ok"
    env["TORCHVITALS_SUPERVISOR_STORE_PASSWORD_FILE"] = str(tmp_path / "missing")
    env.pop("TORCHVITALS_SUPERVISOR_STORE_PASSWORD")
    with pytest.raises(ValueError, match=r"store_password_file .*missing"):
        store_of(SupervisorConfig.from_env(env))


# ---------------------------------------------------------------- what a job leaves


def config(**changes) -> SupervisorConfig:
    base = SupervisorConfig(
        nnodes=2,
        store_url="http://unused",
        node_ttl_s=3,
        store_poll_s=0.05,
        peer_timeout_s=10,
        job_ttl_s=60,
    )
    return replace(base, **changes)


def two_nodes(etcd, job: str, **changes) -> list[StorePeers]:
    return [
        StorePeers(EtcdStore(etcd.url), job, config(node_rank=n, **changes), SupervisorMetrics())
        for n in range(2)
    ]


def start(nodes: list[StorePeers]) -> None:
    """Join both and pass the start barrier of attempt 1 together, then run it."""
    records = [node.join() for node in nodes]
    assert [r.number for r in records] == [1, 1]
    orders = [None, None]

    def wait(n):
        orders[n] = nodes[n].wait_for_peers(1)

    threads = [threading.Thread(target=wait, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert orders == [StartAttempt(1), StartAttempt(1)], orders
    for node in nodes:
        node.started(1)


def keys(store: EtcdStore, job: str) -> dict[str, int]:
    """The job's keys -> the lease each lives by."""
    return {e.key[len(KEY_ROOT + job) + 1 :]: e.lease for e in store.prefix(f"{KEY_ROOT}{job}/")}


def test_a_running_job_writes_each_step_at_most_once_per_lease_renewal(etcd):
    job = f"steps-{uuid.uuid4().hex[:8]}"
    nodes = two_nodes(etcd, job)
    store = EtcdStore(etcd.url)
    try:
        nodes[0].join()
        # Alone at the barrier for a second (20 polls): waiting is written once, not per poll.
        waiter = threading.Thread(target=nodes[0].wait_for_peers, args=(1,))
        waiter.start()
        time.sleep(1)
        assert store.get(f"{KEY_ROOT}{job}/nodes/00000").version <= 2  # joined, waiting
        nodes[1].join()
        nodes[1].wait_for_peers(1)
        waiter.join(10)
        for node in nodes:
            node.started(1)
        before = store.get(f"{KEY_ROOT}{job}/nodes/00000").version
        started, step = time.monotonic(), 0
        while time.monotonic() - started < 3:  # a step every poll: 20 steps a second
            step += 1
            assert nodes[0].watch(1, step) is None and nodes[1].watch(1, step) is None
            time.sleep(0.05)
        writes = store.get(f"{KEY_ROOT}{job}/nodes/00000").version - before
        # One write per renewal (node_ttl_s / 3 = 1 s) over 3 s, where every poll saw a new
        # step: at most 3 (+1 for the boundary), never the ~60 a write per step would make.
        assert 1 <= writes <= 4, writes
        published = json.loads(store.get(f"{KEY_ROOT}{job}/nodes/00000").value)["step"]
        assert step - published <= 21, (step, published)  # at most a renewal behind
        # Each node publishes its own presence only.
        samples = [
            s
            for m in nodes[0].metrics.registry.collect()
            if m.name == "torchvitals_supervisor_node_present"
            for s in m.samples
        ]
        assert [(s.labels, s.value) for s in samples] == [({"node": "0"}, 1.0)]
        assert (
            nodes[0].metrics.registry.get_sample_value("torchvitals_supervisor_nodes_expected") == 2
        )
    finally:
        for node in nodes:
            node.close()


def test_a_job_that_succeeds_leaves_nothing_in_the_store(etcd):
    job = f"done-{uuid.uuid4().hex[:8]}"
    nodes = two_nodes(etcd, job)
    store = EtcdStore(etcd.url)
    start(nodes)
    found = keys(store, job)
    # Each running node's mark at the start barrier lives by its own lease, as its record.
    marks = {"ready/a0001/00000", "ready/a0001/00001"}
    assert set(found) == {"attempt", "nodes/00000", "nodes/00001"} | marks
    assert found["ready/a0001/00000"] == found["nodes/00000"]
    # The job's record lives by a lease of its own, of job_ttl_s at most, renewed by the nodes.
    job_lease = found["attempt"]
    assert job_lease and job_lease not in (found["nodes/00000"], found["nodes/00001"])
    assert 0 < store.ttl(job_lease) <= 60
    nodes[0].done()
    nodes[0].close()
    # Node 1 still runs: the job's record stays for it.
    assert set(keys(store, job)) == {"attempt", "nodes/00000", "nodes/00001", "ready/a0001/00001"}
    assert keys(store, job)["nodes/00000"] == job_lease  # done: under the job's lease
    nodes[1].done()
    nodes[1].close()
    assert keys(store, job) == {}


def test_a_job_that_ends_for_good_leaves_nothing_in_the_store(etcd):
    job = f"final-{uuid.uuid4().hex[:8]}"
    nodes = two_nodes(etcd, job)
    store = EtcdStore(etcd.url)
    start(nodes)
    assert nodes[0].finish(75, "aborted on purpose") == 75
    assert keys(store, job)["final"] == keys(store, job)["attempt"]
    nodes[0].close()
    assert "final" in keys(store, job)  # node 1 has not read it yet
    time.sleep(0.06)
    order = nodes[1].watch(1, 5)
    assert order == JobEnded(75, "aborted on purpose")
    nodes[1].close()
    assert keys(store, job) == {}


ABANDONED = """
import sys, time
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.etcd import EtcdStore
from torchvitals.supervisor.telemetry import SupervisorMetrics
from torchvitals.supervisor.store_peers import StorePeers
config = SupervisorConfig(nnodes=2, node_rank=int(sys.argv[3]), store_url=sys.argv[1],
                          node_ttl_s=1, job_ttl_s=3)
StorePeers(EtcdStore(sys.argv[1]), sys.argv[2], config, SupervisorMetrics()).join()
print("joined", flush=True)
time.sleep(600)
"""


def test_a_job_whose_nodes_all_vanish_is_gone_from_the_store_within_job_ttl(etcd):
    job = f"vanished-{uuid.uuid4().hex[:8]}"
    store = EtcdStore(etcd.url)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ABANDONED, etcd.url, job, str(n)],
            env={**os.environ, "PYTHONPATH": PYTHONPATH},
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "joined"
        assert set(keys(store, job)) == {"attempt", "nodes/00000", "nodes/00001"}
        time.sleep(2)
        assert "attempt" in keys(store, job)  # renewed while a node lives
        for proc in procs:  # the whole allocation killed: no close()
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        killed = time.monotonic()
        deadline = killed + 3 + 4  # job_ttl_s, plus etcd's expiry sweep
        while keys(store, job) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert keys(store, job) == {}, keys(store, job)
        print(
            f"\nabandoned job: its keys gone {time.monotonic() - killed:.1f} s after the kill "
            "(job_ttl_s 3)"
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
