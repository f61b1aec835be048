"""The chart's example PyTorchJob wires one job identity and the supervisors' agreement: every
pod gets the same job id, resume "restart" (never a hard-coded "auto"), the store (yours, or the
chart's etcd on several nodes), its TLS files and user, the node count, and the timeouts, which
the supervisor's config reads as they are.

    python -m pytest tests/multinode/test_chart_wiring.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))

import test_helm_chart
from test_helm_chart import VALUE_SETS, container_env, one, render

from torchvitals.supervisor.options import SupervisorConfig, node_rank

chart = test_helm_chart.chart
"""The loaded chart, the fixture tests/deploy/test_helm_chart.py uses (one per module)."""


def pods(docs):
    replicas = one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    return [container_env(spec["template"]["spec"]["containers"][0]) for spec in replicas.values()]


def test_every_pod_gets_one_job_id_and_the_store(chart):
    envs = pods(render(chart, VALUE_SETS["full-values"]))
    assert len(envs) == 2  # Master, Workers
    for env in envs:
        assert env["TORCHVITALS_JOB_ID"] == "run-42"
        assert env["TORCHVITALS_RESUME"] == "restart"
        supervisor = {k: v for k, v in env.items() if k.startswith("TORCHVITALS_SUPERVISOR_")}
        # The operator's PET_NODE_RANK gives each pod its node rank.
        # The downward API's pod IP, as the kubelet would fill it in.
        supervisor["TORCHVITALS_SUPERVISOR_METRICS_HOST"] = "10.1.2.3"
        config = SupervisorConfig.from_env({**supervisor, "PET_NODE_RANK": "2"})
        assert (
            config.store_url,
            config.nnodes,
            config.node_ttl_s,
            config.peer_timeout_s,
            config.job_ttl_s,
        ) == ("https://etcd.ml.svc:2379", 3, 20.0, 300.0, 7200.0)
        assert (config.store_user, config.store_password_file, config.store_password) == (
            "torchvitals",
            "/etc/torchvitals/store-auth/password",
            None,
        )
        assert config.store_cafile.endswith("/ca.crt") and config.store_keyfile.endswith(".key")
        assert (config.metrics_host, config.metrics_port) == ("10.1.2.3", 9501)
        assert node_rank(config, {"PET_NODE_RANK": "2"}) == 2


def test_by_default_every_pod_agrees_through_the_charts_etcd(chart):
    values = {"exampleJob": {"enabled": True}}
    docs = render(chart, values)
    name = one(docs, "PyTorchJob")["metadata"]["name"]
    service = next(
        s for s in docs if s["kind"] == "Service" and s["metadata"]["name"] == "tv-torchvitals-etcd"
    )
    envs = pods(docs)
    assert len(envs) == 2
    for env in envs:
        assert env["TORCHVITALS_JOB_ID"] == f"ml/{name}"
        assert env["TORCHVITALS_RESUME"] == "restart"
        supervisor = {
            k: v
            for k, v in env.items()
            if k.startswith("TORCHVITALS_SUPERVISOR_") and isinstance(v, str)
        }
        config = SupervisorConfig.from_env(supervisor)
        assert config.store_url == f"http://{service['metadata']['name']}.ml.svc:2379"
        assert config.nnodes == 2 and config.job_ttl_s == 86400


def test_one_node_acts_alone(chart):
    for env in pods(render(chart, {"exampleJob": {"enabled": True, "nodes": 1}})):
        assert "TORCHVITALS_SUPERVISOR_STORE_URL" not in env
        assert "TORCHVITALS_SUPERVISOR_NNODES" not in env


@pytest.mark.parametrize("bad", [{"storeUrl": 5}, {"nodeTtlSeconds": 0}, {"peerTimeout": 3}])
def test_wrong_supervisor_values_fail_at_install(chart, bad):
    with pytest.raises(Exception, match=r"(?i)schema|values"):
        render(chart, {"exampleJob": {"enabled": True, "supervisor": bad}})
