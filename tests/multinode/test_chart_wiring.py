"""The chart's example PyTorchJob wires one job identity and, given a store, the supervisors'
agreement: every pod gets the same job id, resume "restart" (never a hard-coded "auto"), the
store, the node count, and the timeouts, which the supervisor's config reads as they are.

    python -m pytest tests/multinode/test_chart_wiring.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))

from test_helm_chart import VALUE_SETS, chart, container_env, one, render  # noqa: E402,F401
from torchvitals.collector.supervisor.config import SupervisorConfig, node_rank  # noqa: E402


def pods(docs):
    replicas = one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    return [container_env(spec["template"]["spec"]["containers"][0]) for spec in replicas.values()]


def test_every_pod_gets_one_job_id_and_the_store(chart):
    envs = pods(render(chart, VALUE_SETS["full-values"]))
    assert len(envs) == 2                                      # Master, Workers
    for env in envs:
        assert env["TORCHVITALS_JOB_ID"] == "run-42"
        assert env["TORCHVITALS_RESUME"] == "restart"
        supervisor = {k: v for k, v in env.items() if k.startswith("TORCHVITALS_SUPERVISOR_")}
        # The operator's PET_NODE_RANK gives each pod its node rank.
        config = SupervisorConfig.from_env({**supervisor, "PET_NODE_RANK": "2"})
        assert (config.store_url, config.nnodes, config.node_ttl_s, config.peer_timeout_s) == \
            ("http://etcd.ml.svc:2379", 3, 20.0, 300.0)
        assert node_rank(config, {"PET_NODE_RANK": "2"}) == 2


def test_by_default_the_job_id_is_the_jobs_name_and_each_pod_acts_alone(chart):
    values = {"exampleJob": {"enabled": True}}
    envs = pods(render(chart, values))
    name = one(render(chart, values), "PyTorchJob")["metadata"]["name"]
    for env in envs:
        assert env["TORCHVITALS_JOB_ID"] == f"ml/{name}"
        assert env["TORCHVITALS_RESUME"] == "restart"
        assert not [k for k in env if k.startswith("TORCHVITALS_SUPERVISOR_")]


@pytest.mark.parametrize("bad", [{"storeUrl": 5}, {"nodeTtlSeconds": 0}, {"peerTimeout": 3}])
def test_wrong_supervisor_values_fail_at_install(chart, bad):
    with pytest.raises(Exception, match="(?i)schema|values"):
        render(chart, {"exampleJob": {"enabled": True, "supervisor": bad}})
