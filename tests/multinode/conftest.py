"""What the multi-node tests share: one real etcd per module (and one with TLS, client
certificates and authentication), and a maker of simulated jobs that fails the test when any of
a job's processes outlives it."""

from __future__ import annotations

import re
import uuid

import pytest
from cluster import PASSWORDS, Certs, Cluster, Etcd


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with Etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return Certs.make(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory, certs):
    """etcd with TLS, client certificates and ``PASSWORDS``; its tokens live 1 s unused, so a
    test sees one expire (a client's, or a watch's own while it holds)."""
    with Etcd(
        tmp_path_factory.mktemp("etcd-auth"), certs=certs, args=["--auth-token-ttl", "1"]
    ) as server:
        server.enable_auth(PASSWORDS)
        yield server


@pytest.fixture
def clusters(tmp_path, etcd, request):
    """Makes a ``Cluster`` on the module's etcd, named after the test unless ``job`` is given;
    afterwards stops every job it made and asserts none left a process behind."""
    made: list[Cluster] = []

    def make(job: str | None = None, **kwargs) -> Cluster:
        name = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[-40:].strip("-")
        made.append(Cluster(tmp_path, etcd.url, job or f"{name}-{uuid.uuid4().hex[:8]}", **kwargs))
        return made[-1]

    yield make
    for c in made:
        left = [(p.pid, " ".join(p.cmdline()[:4])) for p in c.processes()]
        c.stop_all()
        assert not left, f"processes left behind: {left}"
