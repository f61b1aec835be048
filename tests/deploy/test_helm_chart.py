"""The Helm chart, rendered and linted by the real Helm engine (helm-python-sdk, in-process).

Every manifest rendered with the default values and with each ``helm/torchvitals/ci/*.yaml`` is
validated: core objects by kubernetes-validate (strict: an unknown field fails), custom
resources by the schemas of ``crd_schemas.py``; the chart's copies of the alert rules and
dashboards must equal the canonical files in grafana/.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from crd_schemas import SCHEMAS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "torchvitals"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
VALUE_SETS = {"defaults": {}} | {p.stem: yaml.safe_load(p.read_text()) for p in CI_VALUES}
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]
CORE_GROUPS = {"v1", "apps/v1", "networking.k8s.io/v1"}


def _sync_module():
    spec = importlib.util.spec_from_file_location("helm_sync", ROOT / "helm" / "sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart, values: dict | None = None) -> list[dict]:
    """Every object the chart renders for ``values`` (release tv in namespace ml)."""
    manifests = chart.render(values or {}, name="tv", namespace="ml", is_install=True)
    docs = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def token_secrets(docs: list[dict]) -> list[dict]:
    """The Secrets holding tokens: all but the example job's checkpoint key."""
    return [
        d for d in by_kind(docs, "Secret") if not d["metadata"]["name"].endswith("-checkpoint-key")
    ]


def container_env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_is_clean(name):
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); warnings (2) and errors (3) fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_manifest_matches_its_schema(chart, name):
    docs = render(chart, VALUE_SETS[name])
    assert docs
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"] in CORE_GROUPS:
            for version in KUBE_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(
                        f"{where} invalid for Kubernetes {version}: {exc.message} "
                        f"at {list(exc.path)}"
                    )
        else:
            assert key in SCHEMAS, f"{where}: no schema for {key}"
            jsonschema.validate(doc, SCHEMAS[key])
        if doc["kind"] == "PyTorchJob":
            for role, spec in doc["spec"]["pytorchReplicaSpecs"].items():
                template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{doc['metadata']['name']}-{role.lower()}"},
                    "template": spec["template"],
                }
                for version in KUBE_VERSIONS:
                    kubernetes_validate.validate(template, version, strict=True)


def test_each_component_sits_behind_its_enabled_flag(chart):
    everything = render(chart, VALUE_SETS["full-values"])
    kinds = {d["kind"] for d in everything}
    assert kinds >= {
        "Deployment",
        "Service",
        "Secret",
        "PersistentVolumeClaim",
        "PodMonitor",
        "ServiceMonitor",
        "PrometheusRule",
        "AlertmanagerConfig",
        "ConfigMap",
        "PyTorchJob",
    }
    switches = {
        "collector": (
            {"collector": {"enabled": False}},
            {"Deployment", "Service", "ServiceMonitor", "AlertmanagerConfig"},
        ),
        "podMonitor": ({"scraping": {"podMonitor": {"enabled": False}}}, {"PodMonitor"}),
        "rules": ({"rules": {"enabled": False}}, {"PrometheusRule"}),
        "alertmanagerConfig": (
            {"alertmanager": {"alertmanagerConfig": {"enabled": False}}},
            {"AlertmanagerConfig"},
        ),
        "exampleJob": ({"exampleJob": {"enabled": False}}, {"PyTorchJob"}),
    }
    for name, (off, gone) in switches.items():
        values = yaml.safe_load(yaml.safe_dump(VALUE_SETS["full-values"]))
        for key, sub in off.items():
            values.setdefault(key, {})
            for k, v in sub.items():
                values[key][k] = {**values[key].get(k, {}), **v} if isinstance(v, dict) else v
        left = {d["kind"] for d in render(chart, values)}
        assert not (left & gone), f"{name} off still renders {left & gone}"

    def config_maps(docs):
        return {d["metadata"]["name"] for d in by_kind(docs, "ConfigMap")}

    full = config_maps(everything)
    for off, suffix in [
        ({"scraping": {"scrapeConfig": {"enabled": False}}}, "-scrape-config"),
        ({"alertmanager": {"snippet": {"enabled": False}}}, "-alertmanager-snippet"),
    ]:
        assert "tv-torchvitals" + suffix in full
        assert "tv-torchvitals" + suffix not in config_maps(render(chart, off))
    with_dashboards = {n for n in full if "-dashboard-" in n}
    no_dashboards = config_maps(render(chart, {"dashboards": {"enabled": False}}))
    assert not {n for n in no_dashboards if "-dashboard-" in n}
    assert len(with_dashboards) == len(list((ROOT / "grafana" / "dashboards").glob("*.json")))


@pytest.mark.parametrize(
    "values",
    [
        {"collector": {"port": "9500"}},
        {"collector": {"replicas": 2}},  # not a value of this chart
        {"colector": {"enabled": False}},  # a typo
        {"scraping": {"portPrefix": "Rank_"}},  # not a valid port name
        {"scraping": {"ranksPerPod": 0}},
        {"alertmanager": {"matchers": ["severity: critical"]}},  # not matcher syntax
        {"exampleJob": {"nodes": 0}},
        {"exampleJob": {"image": {"pullPolicy": "Sometimes"}}},
        {"collector": {"resources": {"requests": {"memory": "lots"}}}},
        {"webhookToken": {"value": 12345}},
        {"exampleJob": {"supervisor": {"storeUrl": "etcd.ml.svc:2379"}}},  # no scheme
        {"etcd": {"replicas": 2}},  # no quorum to lose one of
        {"etcd": {"quotaBackendBytes": 1024}},
        {"etcd": {"autoCompactionRetention": "an hour"}},
        {"etcd": {"tls": {"serverSecret": ""}}},
    ],
)
def test_wrong_values_fail_at_install(chart, values):
    with pytest.raises(helm.HelmValuesError):
        chart.render(values, name="tv", namespace="ml", is_install=True)
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)


def test_more_ranks_than_scraped_ports_fails_at_install(chart):
    with pytest.raises(helm.HelmRenderError, match="ranksPerPod"):
        render(chart, {"exampleJob": {"enabled": True, "nprocPerNode": 9}})


def test_defaults_hold_no_token_and_the_chart_generates_one(chart):
    assert chart.values["webhookToken"] == {"value": "", "existingSecret": "", "key": "token"}
    tokens = []
    for _ in range(2):
        secret = one(render(chart), "Secret")
        tokens.append(base64.b64decode(secret["data"]["token"]).decode())
    assert all(re.fullmatch(r"[A-Za-z0-9]{48}", t) for t in tokens)
    assert tokens[0] != tokens[1], "a fixed token would be the same in every installation"


def test_a_given_token_lands_in_the_secret_and_nowhere_else(chart):
    token = "s3cr3t-" + "x" * 20
    docs = render(chart, {"webhookToken": {"value": token}, "exampleJob": {"enabled": True}})
    (secret,) = token_secrets(docs)
    assert base64.b64decode(secret["data"]["token"]).decode() == token
    others = yaml.safe_dump_all([d for d in docs if d["kind"] != "Secret"])
    assert token not in others


def test_an_existing_secret_is_referenced_and_none_is_created(chart):
    docs = render(chart, VALUE_SETS["existing-secret-values"])
    assert token_secrets(docs) == []
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    token_volume = next(v for v in pod["volumes"] if v["name"] == "webhook-token")
    assert token_volume["secret"]["secretName"] == "torchvitals-webhook"
    assert token_volume["secret"]["items"] == [{"key": "bearer", "path": "bearer"}]
    env = container_env(pod["containers"][0])
    assert env["TORCHVITALS_WEBHOOK_TOKEN_FILE"] == "/etc/torchvitals/webhook/bearer"
    job = one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    assert set(job) == {"Master"}
    trainer = container_env(job["Master"]["template"]["spec"]["containers"][0])
    # The job's own token, never Alertmanager's (which may post alerts only).
    assert trainer["TORCHVITALS_WEBHOOK_TOKEN"] == {
        "secretKeyRef": {"name": "torchvitals-job-tokens", "key": "job-tv-torchvitals-example"}
    }
    jobs_volume = next(v for v in pod["volumes"] if v["name"] == "job-tokens")
    assert jobs_volume["secret"]["secretName"] == "torchvitals-job-tokens"
    claim = next(v for v in pod["volumes"] if v["name"] == "state")
    assert claim["persistentVolumeClaim"]["claimName"] == "torchvitals-state"
    assert by_kind(docs, "PersistentVolumeClaim") == []  # both claims exist already


def test_collector_runs_non_root_read_only_with_requests(chart):
    docs = render(chart, VALUE_SETS["full-values"])
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert (
        container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    )
    assert container["command"] == ["torchvitals-collector"]
    env = container_env(container)
    assert env["TORCHVITALS_COLLECTOR_HOST"] == "0.0.0.0"
    assert env["TORCHVITALS_COLLECTOR_PORT"] == "9500"
    assert env["TORCHVITALS_COLLECTOR_MAX_BODY_BYTES"] == "1048576"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[env["TORCHVITALS_COLLECTOR_STATE_DIR"]] == "state"
    claim = next(v for v in pod["volumes"] if v["name"] == "state")["persistentVolumeClaim"]
    assert claim["claimName"] in {
        d["metadata"]["name"] for d in by_kind(docs, "PersistentVolumeClaim")
    }
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= pod_labels(one(docs, "Deployment")).items()


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def test_the_example_job_is_scraped_rank_by_rank_under_its_collector_job_name(chart):
    docs = render(chart, VALUE_SETS["full-values"])
    job = one(docs, "PyTorchJob")
    monitor = one(docs, "PodMonitor")["spec"]
    scraped_ports = {e["port"] for e in monitor["podMetricsEndpoints"]}
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 3
    assert job["spec"]["nprocPerNode"] == "4"
    for spec in replicas.values():
        template = spec["template"]
        labels = template["metadata"]["labels"]
        assert monitor["selector"]["matchLabels"].items() <= labels.items()
        (container,) = template["spec"]["containers"]
        assert container["name"] == "pytorch"
        env = container_env(container)
        # The series' job label (from the pod label) is the name the job polls directives for.
        assert labels[monitor["jobLabel"]] == env["TORCHVITALS_COLLECTOR_JOB"]
        assert env["TORCHVITALS_METRICS_HOST"] == "0.0.0.0"
        assert env["TORCHVITALS_COLLECTOR_URL"] == "http://tv-torchvitals-collector.ml.svc:9500"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        base = int(env["TORCHVITALS_METRICS_PORT"])
        for rank in range(4):
            assert ports[f"tv-rank-{rank}"] == base + rank
            assert f"tv-rank-{rank}" in scraped_ports
        command = container["command"]
        assert command[:2] == ["torchvitals", "supervise"] and "torchrun" in command
        assert command[command.index("--checkpoint-dir") + 1] == env["TORCHVITALS_CHECKPOINT_DIR"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert any(env["TORCHVITALS_CHECKPOINT_DIR"].startswith(m + "/") for m in mounts)
        script = command[command.index("torchrun") + 1]
        assert (ROOT / script).is_file(), f"the job runs {script}, which is not in the image"
    (claim,) = by_kind(docs, "PersistentVolumeClaim")[1:] or [None]
    assert claim is not None and claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_chart_copies_equal_the_canonical_rules_and_dashboards(chart):
    sync = _sync_module()
    assert sync.stale() == [], "run: python helm/sync.py"
    canonical_rules = sorted((ROOT / "grafana" / "rules").glob("*.rules.yml"))
    assert canonical_rules, "grafana/rules/ holds no rule file"
    docs = render(chart)
    groups = [g for p in canonical_rules for g in yaml.safe_load(p.read_text())["groups"]]
    assert one(docs, "PrometheusRule")["spec"]["groups"] == groups
    dashboards = {p.name: p.read_text() for p in (ROOT / "grafana" / "dashboards").glob("*.json")}
    rendered = {}
    for cm in by_kind(docs, "ConfigMap"):
        if cm["metadata"]["labels"].get("grafana_dashboard") == "1":
            rendered.update(cm["data"])
    assert {k: v.rstrip("\n") for k, v in rendered.items()} == {
        k: v.rstrip("\n") for k, v in dashboards.items()
    }


def test_sync_reports_and_repairs_a_stale_copy(tmp_path, monkeypatch):
    sync = _sync_module()
    source = tmp_path / "grafana" / "rules"
    target = tmp_path / "chart" / "rules"
    source.mkdir(parents=True)
    (source / "a.yml").write_text("groups: []\n")
    target.mkdir(parents=True)
    (target / "old.yml").write_text("groups: []\n")
    monkeypatch.setattr(sync, "ROOT", tmp_path)
    monkeypatch.setattr(sync, "COPIES", {source: ("*.yml", target)})
    assert len(sync.stale()) == 2 and sync.main(["--check"]) == 1
    sync.sync()
    assert sync.stale() == [] and sorted(p.name for p in target.iterdir()) == ["a.yml"]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (CI installs it: see docs/deploy.md)")
    return path


def test_plain_scrape_config_passes_promtool(chart, tmp_path):
    docs = render(chart, VALUE_SETS["full-values"])
    cm = next(
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-scrape-config")
    )
    snippet = yaml.safe_load(cm["data"]["torchvitals-scrape.yml"])
    (job,) = snippet["scrape_configs"]
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert {
        "regex": "true",
        "action": "keep",
        "source_labels": ["__meta_kubernetes_pod_label_torchvitals_io_scrape"],
    } in keep
    assert any(
        r.get("target_label") == "job"
        and r["source_labels"] == ["__meta_kubernetes_pod_label_torchvitals_io_job"]
        for r in job["relabel_configs"]
    )
    (sd,) = job["kubernetes_sd_configs"]
    assert sd == {"role": "pod", "namespaces": {"names": ["ml", "ml-staging"]}}
    # Debian's promtool is built without Kubernetes service discovery ("field
    # kubernetes_sd_configs not found"): promtool checks the rest of the job, relabelling
    # included, with the discovery swapped for an empty static one.
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": []}]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"}, **snippet}))
    proc = subprocess.run(
        [_tool("promtool"), "check", "config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alertmanager_snippet_passes_amtool_and_matches_the_alertmanagerconfig(chart, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    docs = render(chart, {"alertmanager": {"snippet": {"credentialsFile": str(token_file)}}})
    cm = next(
        d
        for d in by_kind(docs, "ConfigMap")
        if d["metadata"]["name"].endswith("-alertmanager-snippet")
    )
    snippet = yaml.safe_load(cm["data"]["torchvitals-receiver.yml"])
    config = {
        "route": {"receiver": "default", "routes": snippet["route"]["routes"]},
        "receivers": [{"name": "default"}] + snippet["receivers"],
    }
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [_tool("amtool"), "check-config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (webhook,) = snippet["receivers"][0]["webhook_configs"]
    amc = one(docs, "AlertmanagerConfig")["spec"]
    (amc_webhook,) = amc["receivers"][0]["webhookConfigs"]
    assert (
        webhook["url"] == amc_webhook["url"] == "http://tv-torchvitals-collector.ml.svc:9500/alerts"
    )
    ops = {"=": "=", "=~": "=~", "!=": "!=", "!~": "!~"}
    as_text = [f'{m["name"]}{ops[m["matchType"]]}"{m["value"]}"' for m in amc["route"]["matchers"]]
    assert as_text == snippet["route"]["routes"][0]["matchers"]
    assert amc_webhook["httpConfig"]["authorization"]["credentials"] == {
        "name": "tv-torchvitals-webhook-token",
        "key": "token",
    }


def test_the_chart_routes_to_the_collector_as_the_canonical_alertmanager_config_does(chart):
    canonical = yaml.safe_load((ROOT / "grafana" / "alertmanager" / "alertmanager.yml").read_text())
    webhook_receivers = {
        r["name"]
        for r in canonical["receivers"]
        if any(urlsplit(w["url"]).path == "/alerts" for w in r.get("webhook_configs", []))
    }
    (route,) = [r for r in canonical["route"]["routes"] if r["receiver"] in webhook_receivers]
    docs = render(chart)
    cm = next(
        d
        for d in by_kind(docs, "ConfigMap")
        if d["metadata"]["name"].endswith("-alertmanager-snippet")
    )
    (ours,) = yaml.safe_load(cm["data"]["torchvitals-receiver.yml"])["route"]["routes"]

    def no_spaces(matchers):
        return [re.sub(r"\s*(=~|!~|!=|=)\s*", r"\1", m) for m in matchers]

    assert no_spaces(ours["matchers"]) == no_spaces(route["matchers"])
    for key in ("group_by", "group_wait", "group_interval", "repeat_interval", "continue"):
        assert ours[key] == route[key], key
    amc = one(docs, "AlertmanagerConfig")["spec"]["route"]
    assert (amc["groupBy"], amc["groupWait"], amc["groupInterval"], amc["repeatInterval"]) == (
        route["group_by"],
        route["group_wait"],
        route["group_interval"],
        route["repeat_interval"],
    )


def test_each_job_gets_its_own_token_and_the_collector_only_their_digests(chart):
    webhook = "w3bh00k-" + "x" * 20
    docs = render(
        chart,
        {
            "webhookToken": {"value": webhook},
            "exampleJob": {"enabled": True},
            "jobTokens": {"jobs": ["train-b"]},
        },
    )
    (secret,) = token_secrets(docs)
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(data) == {"token", "job-tokens.json", "job-tv-torchvitals-example", "job-train-b"}
    digests = json.loads(data["job-tokens.json"])
    for job in ("tv-torchvitals-example", "train-b"):
        token = data[f"job-{job}"]
        assert re.fullmatch(r"[A-Za-z0-9]{48}", token) and token != webhook
        assert digests[job] == "sha256:" + hashlib.sha256(token.encode()).hexdigest()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    env = container_env(pod["containers"][0])
    assert env["TORCHVITALS_COLLECTOR_JOB_TOKENS_FILE"] == "/etc/torchvitals/jobs/job-tokens.json"
    jobs_volume = next(v for v in pod["volumes"] if v["name"] == "job-tokens")
    assert jobs_volume["secret"]["items"] == [{"key": "job-tokens.json", "path": "job-tokens.json"}]
    master = one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]
    trainer = container_env(master["template"]["spec"]["containers"][0])
    assert trainer["TORCHVITALS_WEBHOOK_TOKEN"] == {
        "secretKeyRef": {
            "name": "tv-torchvitals-webhook-token",
            "key": "job-tv-torchvitals-example",
        }
    }
    assert {
        "TORCHVITALS_COLLECTOR_MAX_JOBS",
        "TORCHVITALS_COLLECTOR_DIRECTIVE_TTL_SECONDS",
        "TORCHVITALS_COLLECTOR_RETENTION_SECONDS",
        "TORCHVITALS_COLLECTOR_MAX_LABEL_BYTES",
    } <= set(env)


def test_job_tokens_get_their_own_secret_beside_an_existing_webhook_secret(chart):
    docs = render(
        chart, {"webhookToken": {"existingSecret": "am-token"}, "exampleJob": {"enabled": True}}
    )
    [secret] = token_secrets(docs)
    assert secret["metadata"]["name"] == "tv-torchvitals-job-tokens"
    assert set(secret["data"]) == {"job-tokens.json", "job-tv-torchvitals-example"}


def test_tls_scraping_is_wired_on_both_sides(chart, tmp_path):
    """With scraping.tls on, every PodMonitor endpoint scrapes HTTPS with the scraper's client
    certificate, the agents serve HTTPS and require one (TORCHVITALS_METRICS_*), and the plain
    scrape config passes promtool with real certificate files."""
    docs = render(chart, VALUE_SETS["tls-values"])
    endpoints = one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    secret = {"name": "prometheus-scrape-tls"}
    for ep in endpoints:
        assert ep["scheme"] == "https"
        assert ep["tlsConfig"] == {
            "serverName": "trainer.ml.svc",
            "ca": {"secret": {**secret, "key": "ca.crt"}},
            "cert": {"secret": {**secret, "key": "tls.crt"}},
            "keySecret": {**secret, "key": "tls.key"},
        }
    job = one(docs, "PyTorchJob")
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        (container,) = pod["containers"]
        env = container_env(container)
        assert env["TORCHVITALS_METRICS_CERTFILE"] == "/etc/torchvitals/tls/tls.crt"
        assert env["TORCHVITALS_METRICS_CLIENT_CAFILE"] == "/etc/torchvitals/tls/ca.crt"
        assert env["TORCHVITALS_METRICS_CLIENT_AUTH_REQUIRED"] == "1"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["metrics-tls"] == "/etc/torchvitals/tls"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["metrics-tls"]["secret"]["secretName"] == "trainer-metrics-tls"
    # The agent reads those variables into a config that serves HTTPS and demands certificates.
    from torchvitals.agent.config import Config

    config = Config.from_env({k: v for k, v in env.items() if k.startswith("TORCHVITALS_METRICS")})
    assert config.metrics_client_auth_required and config.metrics_certfile.endswith("tls.crt")

    cm = next(
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-scrape-config")
    )
    (scrape,) = yaml.safe_load(cm["data"]["torchvitals-scrape.yml"])["scrape_configs"]
    assert scrape["scheme"] == "https" and scrape["tls_config"]["server_name"] == "trainer.ml.svc"
    files = scrape["tls_config"]
    for key in ("ca_file", "cert_file", "key_file"):
        assert files[key].startswith("/etc/prometheus/torchvitals-tls/")
    # promtool opens the files a tls_config names: give it real ones at those names.
    d = tmp_path / "tls"
    d.mkdir()
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=tv",
            "-keyout",
            str(d / "tls.key"),
            "-out",
            str(d / "tls.crt"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    shutil.copy(d / "tls.crt", d / "ca.crt")
    for key, name in (("ca_file", "ca.crt"), ("cert_file", "tls.crt"), ("key_file", "tls.key")):
        files[key] = str(d / name)
    del scrape["kubernetes_sd_configs"]
    scrape["static_configs"] = [{"targets": []}]
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(
        yaml.safe_dump({"global": {"scrape_interval": "15s"}, "scrape_configs": [scrape]})
    )
    proc = subprocess.run(
        [_tool("promtool"), "check", "config", str(config_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_node_of_the_example_job_signs_checkpoints_with_one_kept_key(chart):
    """One secret key for the whole job, made at install (or the user's), read by every node:
    the checkpoints one node signs, any other node (a replaced pod) verifies."""
    docs = render(chart, VALUE_SETS["full-values"])
    job = one(docs, "PyTorchJob")
    refs = set()
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        (entry,) = [e for e in container["env"] if e["name"] == "TORCHVITALS_CHECKPOINT_KEY"]
        ref = entry["valueFrom"]["secretKeyRef"]
        refs.add((ref["name"], ref["key"]))
    ((name, key),) = refs
    secret = next(d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == name)
    value = base64.b64decode(secret["data"][key]).decode()
    assert (
        len(value) >= 32 and secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    )
    from torchvitals.agent.recover.trust import CheckpointKey

    assert CheckpointKey.from_env({"TORCHVITALS_CHECKPOINT_KEY": value}).sign({"step": 1})

    docs = render(
        chart,
        {
            **VALUE_SETS["full-values"],
            "exampleJob": {
                **VALUE_SETS["full-values"]["exampleJob"],
                "checkpoint": {"keySecret": "my-checkpoint-key"},
            },
        },
    )
    assert not [
        d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-checkpoint-key")
    ]
    job = one(docs, "PyTorchJob")
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        (entry,) = [e for e in container["env"] if e["name"] == "TORCHVITALS_CHECKPOINT_KEY"]
        assert entry["valueFrom"]["secretKeyRef"] == {"name": "my-checkpoint-key", "key": "key"}


# ---------------------------------------------------------------- the store a job agrees through


def pod_specs(docs: list[dict]) -> list[dict]:
    """The example job's pod specs, Master first."""
    replicas = one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    return [replicas[role]["template"]["spec"] for role in sorted(replicas)]


def etcd_flags(docs: list[dict]) -> dict[str, str]:
    (container,) = one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return dict(arg[2:].partition("=")[::2] for arg in container["args"])


def test_a_multi_node_job_without_a_store_gets_the_charts_etcd_compacted_and_capped(chart):
    docs = render(chart, {"exampleJob": {"enabled": True}})
    etcd = one(docs, "StatefulSet")
    assert etcd["spec"]["replicas"] == 1
    flags = etcd_flags(docs)
    # History is compacted every hour and the database capped, so a store that serves jobs
    # for months never reaches etcd's own quota.
    assert flags["auto-compaction-mode"] == "periodic"
    assert flags["auto-compaction-retention"] == "1h"
    assert int(flags["quota-backend-bytes"]) == 512 * 2**20
    claim = etcd["spec"]["volumeClaimTemplates"][0]["spec"]
    # The quota fits the volume (1Gi): etcd refuses writes before the disk is full.
    assert claim["accessModes"] == ["ReadWriteOnce"]
    assert claim["resources"]["requests"]["storage"] == "1Gi"
    services = {s["metadata"]["name"]: s["spec"] for s in by_kind(docs, "Service")}
    peers = services[etcd["spec"]["serviceName"]]
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
    client = services["tv-torchvitals-etcd"]
    assert client["selector"].items() <= pod_labels(etcd).items()
    assert [p["port"] for p in client["ports"]] == [2379]
    for spec in pod_specs(docs):
        env = container_env(spec["containers"][0])
        assert env["TORCHVITALS_SUPERVISOR_STORE_URL"] == "http://tv-torchvitals-etcd.ml.svc:2379"
        assert env["TORCHVITALS_SUPERVISOR_NNODES"] == "2"
    # Only the job's pods reach it.
    policy = one(docs, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels(etcd).items()
    job_pod_labels = one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"][
        "metadata"
    ]["labels"]
    client_rule = next(
        r for r in policy["ingress"] if r["ports"] == [{"port": 2379, "protocol": "TCP"}]
    )
    assert client_rule["from"][0]["podSelector"]["matchLabels"].items() <= job_pod_labels.items()


def test_a_job_with_its_own_store_gets_no_etcd_from_the_chart(chart):
    for values in (
        {"exampleJob": {"enabled": True, "supervisor": {"storeUrl": "http://etcd.ml.svc:2379"}}},
        {"exampleJob": {"enabled": True, "nodes": 1}},
    ):
        docs = render(chart, values)
        assert not by_kind(docs, "StatefulSet") and not by_kind(docs, "NetworkPolicy")
        assert not [s for s in by_kind(docs, "Service") if "etcd" in s["metadata"]["name"]]
    (env,) = {frozenset(container_env(spec["containers"][0])) for spec in pod_specs(docs)}
    assert "TORCHVITALS_SUPERVISOR_STORE_URL" not in env  # one node: nothing to agree on


def test_a_multi_node_job_with_the_charts_etcd_off_and_no_store_fails_naming_store_url(chart):
    with pytest.raises(helm.HelmRenderError, match=r"exampleJob\.supervisor\.storeUrl"):
        render(chart, {"exampleJob": {"enabled": True, "nodes": 3}, "etcd": {"enabled": False}})
    # One node needs no store; your own store needs no chart's etcd.
    assert render(chart, {"exampleJob": {"enabled": True, "nodes": 1}, "etcd": {"enabled": False}})
    assert render(
        chart,
        {
            "exampleJob": {"enabled": True, "supervisor": {"storeUrl": "https://etcd:2379"}},
            "etcd": {"enabled": False},
        },
    )


def test_the_charts_etcd_over_tls_requires_and_wires_the_supervisors_certificates(chart):
    docs = render(chart, VALUE_SETS["etcd-tls-values"])
    flags = etcd_flags(docs)
    assert "client-cert-auth" in flags and "peer-client-cert-auth" in flags
    assert flags["listen-client-urls"].startswith("https://")
    assert flags["initial-cluster"].count("=https://") == 3
    etcd_pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in etcd_pod["volumes"]}["tls"]["secret"][
        "secretName"
    ] == "trainer-etcd-server-tls"
    assert len(pod_specs(docs)) == 2  # Master + 3 Workers
    for spec in pod_specs(docs):
        (container,) = spec["containers"]
        env = container_env(container)
        assert env["TORCHVITALS_SUPERVISOR_STORE_URL"] == "https://tv-torchvitals-etcd.ml.svc:2379"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        for key, name in (("CAFILE", "ca.crt"), ("CERTFILE", "tls.crt"), ("KEYFILE", "tls.key")):
            assert env[f"TORCHVITALS_SUPERVISOR_STORE_{key}"] == f"{mounts['store-tls']}/{name}"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["store-tls"]["secret"]["secretName"] == "trainer-etcd-client-tls"
    without = yaml.safe_load(yaml.safe_dump(VALUE_SETS["etcd-tls-values"]))
    del without["exampleJob"]["supervisor"]["tls"]
    with pytest.raises(helm.HelmRenderError, match=r"exampleJob\.supervisor\.tls\.secret"):
        render(chart, without)
    with pytest.raises(helm.HelmRenderError, match="plain http"):
        render(
            chart,
            {
                "exampleJob": {
                    "enabled": True,
                    "supervisor": {"storeUrl": "http://etcd:2379", "tls": {"secret": "client-tls"}},
                }
            },
        )


def test_the_store_password_reaches_the_supervisor_as_a_mounted_file_only(chart):
    docs = render(chart, VALUE_SETS["full-values"])
    for spec in pod_specs(docs):
        (container,) = spec["containers"]
        env = container_env(container)
        assert env["TORCHVITALS_SUPERVISOR_STORE_USER"] == "torchvitals"
        assert "TORCHVITALS_SUPERVISOR_STORE_PASSWORD" not in env
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert (
            env["TORCHVITALS_SUPERVISOR_STORE_PASSWORD_FILE"] == f"{mounts['store-auth']}/password"
        )
        secret = {v["name"]: v for v in spec["volumes"]}["store-auth"]["secret"]
        assert secret["secretName"] == "etcd-torchvitals-password"
        assert secret["items"] == [{"key": "password", "path": "password"}]
        assert not [a for a in container["command"] if "password" in a.lower()]
    with pytest.raises(helm.HelmRenderError, match="passwordSecret"):
        render(
            chart,
            {
                "exampleJob": {
                    "enabled": True,
                    "supervisor": {
                        "storeUrl": "https://etcd:2379",
                        "auth": {"user": "torchvitals"},
                    },
                }
            },
        )


@pytest.mark.parametrize("tls", [False, True])
def test_every_supervisor_serves_metrics_on_its_pod_ip_and_is_scraped(chart, tls):
    docs = render(chart, VALUE_SETS["tls-values"] if tls else {"exampleJob": {"enabled": True}})
    monitor = one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    (supervisor_endpoint,) = [e for e in monitor if e["port"] == "tv-supervisor"]
    assert supervisor_endpoint.get("scheme", "http") == ("https" if tls else "http")
    for spec in pod_specs(docs):
        (container,) = spec["containers"]
        env = container_env(container)
        assert env["TORCHVITALS_SUPERVISOR_METRICS_HOST"] == {
            "fieldRef": {"fieldPath": "status.podIP"}
        }
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["tv-supervisor"] == int(env["TORCHVITALS_SUPERVISOR_METRICS_PORT"]) == 9501
        if tls:  # HTTPS with client certificates, as the agents beside it
            assert (
                env["TORCHVITALS_SUPERVISOR_METRICS_CLIENT_CAFILE"]
                == env["TORCHVITALS_METRICS_CLIENT_CAFILE"]
            )
            assert (
                env["TORCHVITALS_SUPERVISOR_METRICS_CERTFILE"]
                == env["TORCHVITALS_METRICS_CERTFILE"]
            )


def test_a_supervisor_port_among_the_ranks_fails_at_install(chart):
    with pytest.raises(helm.HelmRenderError, match="metricsPort 19401 is one of the ranks' ports"):
        render(chart, {"exampleJob": {"enabled": True, "supervisor": {"metricsPort": 19401}}})


def test_the_collector_keeps_its_directives_on_a_claim_by_default_and_never_runs_twice(chart):
    assert chart.values["collector"]["persistence"]["enabled"] is True
    docs = render(chart)
    deployment = one(docs, "Deployment")
    # One collector at a time: the old pod lets go of the ReadWriteOnce claim (and stops
    # issuing directives) before the new one starts.
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["replicas"] == 1
    (claim,) = by_kind(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    pod = deployment["spec"]["template"]["spec"]
    state = next(v for v in pod["volumes"] if v["name"] == "state")
    assert state == {
        "name": "state",
        "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]},
    }
    off = render(chart, {"collector": {"persistence": {"enabled": False}}})
    assert not by_kind(off, "PersistentVolumeClaim")
