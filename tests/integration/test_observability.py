"""The observability stack, proven against real servers.

A real Prometheus scrapes two real 2-rank torchrun jobs and evaluates the canonical alert rules;
a real Alertmanager routes with the canonical config to the real collector. Job "vitals" runs the
watchdog: its NaN makes it roll back by itself, so it gets no order. Job "bare" runs without a
checkpoint folder: its NaN fires TorchvitalsLossNonFinite, Alertmanager delivers the webhook, the
collector issues a rollback directive and the job takes it. Every dashboard panel's PromQL, with
the dashboard's variables substituted, returns data from the live Prometheus.

Job "vitals" has a third target: node 0's supervisor's metrics and goodput exporter, fed by its
own incident and timeline writers (``NodeZeroSupervisor``). Its hang incident is born mid-run, so
the incident alert and the dashboard's incident annotation are proven on a counter series that
starts at 1.

The static checks (promtool, amtool, the rule and dashboard conventions) need no server.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import start_http_server
from promstack import (
    ALERTMANAGER_CONFIG,
    DASHBOARDS,
    REPO,
    RULE_TESTS,
    RULES,
    Alertmanager,
    Prometheus,
    get_json,
    require,
)
from support.world import free_port

from torchvitals.collector import CollectorConfig, CollectorServer
from torchvitals.records.incidents import Culprit, Incident
from torchvitals.records.timeline import StepTimeline
from torchvitals.supervisor.disruptions import Disruptions
from torchvitals.supervisor.goodput_export import GoodputCollector
from torchvitals.supervisor.telemetry import SupervisorMetrics

JOB_SCRIPT = Path(__file__).resolve().parent / "observed_job.py"
RUNBOOKS = REPO / "docs" / "runbooks.md"
PROVISIONING = REPO / "grafana" / "provisioning"
SEVERITIES = {"critical", "warning", "info"}
NAN_AT = 100
"""Loop iteration of the injected NaN: ~5 s in, after Prometheus has scraped the zero counters."""


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def alerts() -> list[dict]:
    return [r for r in rules() if "alert" in r]


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and annotation query of a dashboard."""
    found = []
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {t['refId']}", t["expr"]))
    for a in dashboard["annotations"]["list"]:
        if "expr" in a:
            found.append((f"annotation {a['name']!r}", a["expr"]))
    return found


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Grafana's variable interpolation for the variables our dashboards use."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def load_dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


# ------------------------------------------------------------------ static checks


def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    promtool = require("promtool")
    check = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run(
        [promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert test.returncode == 0, test.stdout + test.stderr


def test_every_alert_follows_the_conventions_and_has_a_runbook_section():
    headings = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^## (.+)$", RUNBOOKS.read_text(), re.M)
    }
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names))
    for a in alerts():
        assert a["labels"]["severity"] in SEVERITIES, a["alert"]
        assert a["labels"].get("torchvitals_action", "rollback") in ("rollback", "abort")
        notes = a["annotations"]
        assert notes["summary"].strip() and notes["description"].strip(), a["alert"]
        anchor = notes["runbook_url"].rsplit("#", 1)[1]
        assert notes["runbook_url"].split("#")[0].endswith("docs/runbooks.md"), a["alert"]
        assert anchor == a["alert"].lower() and anchor in headings, a["alert"]
    for r in rules():
        if "record" in r:
            assert re.fullmatch(r"[a-z_]+:torchvitals_[a-z_]+:[a-z0-9_]+", r["record"]), r["record"]
    # The alerts the on-call plan counts on, with the severity that decides who wakes up.
    expected = {
        "TorchvitalsLossNonFinite": "critical",
        "TorchvitalsLossSpike": "critical",
        "TorchvitalsGradientExplosion": "warning",
        "TorchvitalsLossUnsteady": "warning",
        "TorchvitalsHotLearningRate": "warning",
        "TorchvitalsDeadLayer": "warning",
        "TorchvitalsJobStalled": "critical",
        "TorchvitalsRollbacksTooFrequent": "critical",
        "TorchvitalsRollbackRepeated": "critical",
        "TorchvitalsTransientFault": "warning",
        "TorchvitalsStraggler": "warning",
        "TorchvitalsAgentDown": "critical",
        "TorchvitalsIncident": "critical",
        "TorchvitalsIncidentWarning": "warning",
        "TorchvitalsGoodputLow": "warning",
        "TorchvitalsBadput": "warning",
    }
    assert {
        a["alert"]: a["labels"]["severity"] for a in alerts() if a["alert"] in expected
    } == expected


def test_every_alert_has_a_firing_case_and_every_delayed_alert_a_pending_case():
    cases = [
        c
        for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for c in t.get("alert_rule_test", [])
    ]
    for a in alerts():
        mine = [c for c in cases if c["alertname"] == a["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{a['alert']}: no firing case"
        if "for" in a:
            assert any(not c["exp_alerts"] for c in mine), f"{a['alert']}: no not-yet-firing case"


def _uncomment_examples(text: str) -> str:
    """The config with the commented receiver examples switched on."""
    return re.sub(r"^(\s*)# (\s*(?:- )?[a-z_]+:.*)$", r"\1\2", text, flags=re.M)


def test_the_alertmanager_config_and_its_commented_examples_pass_amtool(tmp_path):
    amtool = require("amtool")
    full = tmp_path / "alertmanager.yml"
    full.write_text(_uncomment_examples(ALERTMANAGER_CONFIG.read_text()))
    receivers = {r["name"]: r for r in yaml.safe_load(full.read_text())["receivers"]}
    assert {"pagerduty_configs", "slack_configs"} <= set(receivers["pager"])
    for path in (ALERTMANAGER_CONFIG, full):
        check = subprocess.run(
            [amtool, "check-config", str(path)], capture_output=True, text=True, timeout=60
        )
        assert check.returncode == 0, check.stdout + check.stderr
    collector = receivers["torchvitals-collector"]["webhook_configs"][0]
    assert collector["url"].endswith("/alerts")
    assert collector["http_config"]["authorization"]["credentials_file"], "token from a file"


def test_alertmanager_routes_critical_torchvitals_alerts_to_the_collector_and_the_pager():
    amtool = require("amtool")

    def receivers(*labels: str) -> list[str]:
        out = subprocess.run(
            [amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}", *labels],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout.strip().split(",")

    assert receivers("alertname=TorchvitalsLossNonFinite", "severity=critical", "job=a") == [
        "torchvitals-collector",
        "pager",
    ]
    assert receivers("alertname=TorchvitalsDeadLayer", "severity=warning", "job=a") == ["tickets"]
    assert receivers("alertname=TorchvitalsRolledBack", "severity=info") == ["default"]
    assert receivers("alertname=NodeDown", "severity=critical") == ["default"]


def test_dashboards_use_the_datasource_variable_and_rate_interval():
    dashboards = load_dashboards()
    assert "training-vitals.json" in dashboards
    for name, d in dashboards.items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource", name
        assert {"job", "block"} <= set(variables), name
        for panel in d["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == "${datasource}", (name, panel["title"])
            assert panel.get("description"), (name, panel["title"])
        for where, expr in dashboard_exprs(d):
            for window in re.findall(r"\b(?:rate|increase|irate)\([^\[]*\[([^\]]+)\]", expr):
                assert window in ("$__rate_interval", "$__range"), (name, where, expr)
            if "torchvitals_" in expr:
                assert 'job="$job"' in expr, (name, where, expr)


def test_the_provisioning_files_point_at_the_dashboards_and_a_prometheus():
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "torchvitals.yml").read_text())
    assert [p["type"] for p in providers["providers"]] == ["file"]
    sources = yaml.safe_load((PROVISIONING / "datasources" / "torchvitals.yml").read_text())
    assert [s["type"] for s in sources["datasources"]] == ["prometheus"]
    assert sum(bool(s.get("isDefault")) for s in sources["datasources"]) == 1, (
        "the dashboards' datasource variable picks the default Prometheus"
    )


# ------------------------------------------------------------------ the live stack

HANG_AFTER_S = 8.0
"""When node 0's supervisor sees the hang: after Prometheus has scraped its counters."""
CULPRIT = {"kind": "hang", "rank": "1", "node": "0", "host": socket.gethostname()}


class NodeZeroSupervisor:
    """Node 0's supervisor as Prometheus scrapes it: its real metrics (``SupervisorMetrics``,
    the incident counter with them) and goodput exporter (``GoodputCollector`` over the job's
    folder), fed by its real writers (``Disruptions``: the incident record and the goodput
    timeline) and global rank 0's step timeline, written here as time passes: attempt 1 trains a
    step every 0.25 s until rank 1 hangs at ``HANG_AFTER_S``; attempt 2 resumes 4 steps back.
    This test runs its jobs under torchrun, not ``torchvitals supervise``, so the supervisor's
    part is played here with its own code."""

    def __init__(self, folder: Path) -> None:
        self.metrics = SupervisorMetrics()
        self.metrics.registry.register(GoodputCollector(folder, refresh_s=0))
        self.book = Disruptions(folder, node=0, host=CULPRIT["host"], metrics=self.metrics)
        self.folder = folder
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="node0-supervisor", daemon=True)

    def serve(self, port: int) -> NodeZeroSupervisor:
        self.server, _ = start_http_server(port, addr="127.0.0.1", registry=self.metrics.registry)
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.server.shutdown()
        self.server.server_close()
        self.book.close()

    def _run(self) -> None:
        t0 = time.time()
        self.book.timeline.waited(1, start=t0, end=t0 + 0.5)
        steps = StepTimeline(self.folder, attempt=1, pid=101)
        steps.start(at=t0 + 1.5, resumed=0)
        step, last, attempt = 0, t0 + 1.5, 1
        while not self.stop.wait(0.25):
            now = time.time()
            if attempt == 1 and now - t0 >= HANG_AFTER_S:
                self.book.record(
                    Incident(
                        kind=CULPRIT["kind"],
                        key="hang-a0001",
                        step=step,
                        culprit=Culprit(rank=1, node=0, host=CULPRIT["host"], pid=4711),
                        cause="rank 1 is stopped (SIGSTOP)",
                        detected_at=now,
                        localized_at=now,
                        attempt=1,
                        writer="supervisor node 0",
                    ),
                    last_advance=last,
                )
                self.book.timeline.attempt(
                    1, start=t0 + 0.5, end=now + 1, reason="hang", status=-15, detected=now
                )
                steps.close()
                self.book.timeline.waited(2, start=now + 1, end=now + 1.5)
                steps = StepTimeline(self.folder, attempt=2, pid=202)
                steps.start(at=now + 2.5, resumed=max(0, step - 4), load_seconds=0.5)
                step, last, attempt = max(0, step - 4), now + 2.5, 2
                self.stop.wait(2.5)
                continue
            step += 1
            steps.step(step, end=now, seconds=now - last)
            last = now
        steps.close()


def free_base_port() -> int:
    """A port P with P and P + 1 free: a 2-rank job serves /metrics on P + LOCAL_RANK."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports")


def launch(tmp: Path, name: str, base_port: int, *extra: str, env: dict) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(JOB_SCRIPT),
        "--out",
        str(tmp / f"{name}.json"),
        "--stop",
        str(tmp / "stop"),
        "--nan-at",
        str(NAN_AT),
        "--job",
        name,
        *extra,
    ]
    with open(tmp / f"{name}.log", "wb") as log:  # the job writes its own copy of the file
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, "TORCHVITALS_METRICS_PORT": str(base_port)},
        )


def directives(state_dir: Path) -> list[dict]:
    """Every directive in the collector's store, read beside it (read-only)."""
    path = state_dir / "directives.sqlite3"
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        db.row_factory = sqlite3.Row
        return [
            {**dict(row), "labels": json.loads(row["labels"])}
            for row in db.execute("SELECT * FROM directives")
        ]
    finally:
        db.close()


def firing(prom: Prometheus, alertname: str, job: str) -> bool:
    return any(
        a["labels"].get("alertname") == alertname
        and a["labels"].get("job") == job
        and a["state"] == "firing"
        for a in prom.alerts()
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Collector, Alertmanager, Prometheus and the two jobs, run until the NaN's consequences
    are in (or 150 s pass); yields what the tests read, then stops everything."""
    tmp = tmp_path_factory.mktemp("stack")
    token = "stack-token-" + os.urandom(8).hex()
    (tmp / "token").write_text(token + "\n")
    # Each job its own token: the webhook token is Alertmanager's only.
    job_tokens = {name: f"{name}-token-" + os.urandom(8).hex() for name in ("vitals", "bare")}
    collector = CollectorServer(
        CollectorConfig(
            port=0,
            state_dir=str(tmp / "collector"),
            webhook_token_file=str(tmp / "token"),
            job_tokens=json.dumps(job_tokens),
            access_log=False,
        )
    ).start()
    # The canonical routing with this test's collector, token file and short timers.
    am_config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    for receiver in am_config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"http://127.0.0.1:{collector.port}/alerts"
            hook["http_config"]["authorization"]["credentials_file"] = str(tmp / "token")
    am_config["route"].update(group_wait="1s", group_interval="1s")
    for route in am_config["route"]["routes"]:
        route.update(group_interval="1s")
    servers: list = []
    jobs: list[subprocess.Popen] = []
    supervisor_port = free_port()
    supervisor = NodeZeroSupervisor(tmp / "job").serve(supervisor_port)
    try:
        am = Alertmanager(tmp / "am", am_config)
        servers.append(am)
        vitals_port, bare_port = free_base_port(), free_base_port()
        prom = Prometheus(
            tmp / "prom",
            {
                "vitals": [
                    f"127.0.0.1:{vitals_port}",
                    f"127.0.0.1:{vitals_port + 1}",
                    f"127.0.0.1:{supervisor_port}",
                ],
                "bare": [f"127.0.0.1:{bare_port}", f"127.0.0.1:{bare_port + 1}"],
            },
            [RULES],
            alertmanager=am.url,
        )
        servers.append(prom)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHVITALS_LOG_DIR": ""}
        started = time.time()
        jobs.append(
            launch(
                tmp,
                "vitals",
                vitals_port,
                "--ckpt",
                str(tmp / "ckpt"),
                env={**env, "TORCHVITALS_WEBHOOK_TOKEN": job_tokens["vitals"]},
            )
        )
        jobs.append(
            launch(
                tmp,
                "bare",
                bare_port,
                "--collector-url",
                f"http://127.0.0.1:{collector.port}",
                env={**env, "TORCHVITALS_WEBHOOK_TOKEN": job_tokens["bare"]},
            )
        )
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            if any(j.poll() is not None for j in jobs):
                break
            acked = [d for d in directives(tmp / "collector") if d["acknowledged_at"]]
            if (
                acked
                and firing(prom, "TorchvitalsRolledBack", "vitals")
                and firing(prom, "TorchvitalsIncident", "vitals")
                and time.time() - started > 30
            ):
                break
            time.sleep(0.5)
        state = {
            "prom": prom,
            "am": am,
            "tmp": tmp,
            "seconds": time.time() - started + 5,
            "directives": directives(tmp / "collector"),
            "nan_alerts": prom.query_range(
                'ALERTS{alertname="TorchvitalsLossNonFinite"}', time.time() - started + 5
            ),
            "alerts": prom.alerts(),
        }
        (tmp / "stop").write_text("stop")
        codes = {}
        for name, job in zip(("vitals", "bare"), jobs):
            try:
                codes[name] = job.wait(60)
            except subprocess.TimeoutExpired:
                job.kill()
                codes[name] = "hung"
        logs = {name: (tmp / f"{name}.log").read_text(errors="replace")[-3000:] for name in codes}
        assert codes == {"vitals": 0, "bare": 0}, (codes, logs)
        state["reports"] = {
            name: json.loads((tmp / f"{name}.json").read_text())["reports"] for name in codes
        }
        yield state
    finally:
        (tmp / "stop").write_text("stop")
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait(10)
        for server in reversed(servers):
            server.stop()
        supervisor.close()
        collector.stop()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_nan_fires_the_alert_and_the_collectors_order_reaches_the_job(stack):
    ordered = [d for d in stack["directives"] if d["job"] == "bare"]
    assert len(ordered) == 1, stack["directives"]
    d = ordered[0]
    assert d["action"] == "rollback" and d["labels"]["alertname"] == "TorchvitalsLossNonFinite"
    assert d["labels"]["severity"] == "critical" and d["acknowledged_at"] is not None
    bare = stack["reports"]["bare"]
    nan = next(r for r in bare if r["tick"] == NAN_AT)
    assert nan["action"] == "skip" and "nonfinite_loss" in nan["verdicts"]
    took = [r for r in bare if "collector_directive" in r["verdicts"]]
    assert len(took) == 1 and took[0]["tick"] > NAN_AT, took


@pytest.mark.slow
@pytest.mark.distributed
def test_a_job_that_rolled_back_by_itself_gets_no_order(stack):
    vitals = stack["reports"]["vitals"]
    nan = next(r for r in vitals if r["tick"] == NAN_AT)
    assert nan["action"] == "rollback" and "nonfinite_loss" in nan["verdicts"]
    assert not [d for d in stack["directives"] if d["job"] == "vitals"]
    assert {s["metric"]["job"] for s in stack["nan_alerts"]} == {"bare"}
    assert not [r for r in vitals if "collector_directive" in r["verdicts"]]


@pytest.mark.slow
@pytest.mark.distributed
def test_every_dashboard_panel_returns_data_from_the_live_prometheus(stack):
    prom = stack["prom"]
    variables = {
        "job": "vitals",
        "block": ".*",
        "__rate_interval": "10s",
        "__interval": "1s",
        "__range": f"{int(stack['seconds'])}s",
        "datasource": "prometheus",
    }
    empty = []
    checked = 0
    for name, dashboard in load_dashboards().items():
        for where, expr in dashboard_exprs(dashboard):
            result = prom.query_range(substitute(expr, variables), stack["seconds"])
            values = [float(v) for series in result for _, v in series["values"]]
            checked += 1
            if not any(math.isfinite(v) for v in values):
                empty.append(f"{name}: {where}: {expr}")
    assert checked >= 25
    assert not empty, "no finite data:\n" + "\n".join(empty)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_dashboard_variables_resolve_against_the_live_prometheus(stack):
    prom = stack["prom"]
    jobs = get_json(f"{prom.url}/api/v1/label/job/values?match[]=torchvitals_build_info")["data"]
    assert {"vitals", "bare"} <= set(jobs)
    blocks = get_json(
        f'{prom.url}/api/v1/label/block/values?match[]=torchvitals_grad_norm{{job="vitals"}}'
    )["data"]
    assert {"emb", "blocks.0", "blocks.1", "head"} <= set(blocks), blocks


@pytest.mark.slow
@pytest.mark.distributed
def test_an_incident_pages_with_its_culprit_in_the_labels_and_the_summary(stack):
    hangs = [
        a
        for a in stack["alerts"]
        if a["labels"]["alertname"] == "TorchvitalsIncident" and a["labels"]["kind"] == "hang"
    ]
    assert len(hangs) == 1, stack["alerts"]
    labels, notes = hangs[0]["labels"], hangs[0]["annotations"]
    assert labels["job"] == "vitals" and labels["severity"] == "critical"
    assert {k: labels.get(k) for k in CULPRIT} == CULPRIT
    assert notes["summary"] == f"vitals: rank 1 on node 0 (host {CULPRIT['host']}) hung."
    # The real job's NaN on rank 1: global rank 0's agent records it and counts it with its
    # culprit, and the same alert names the rank.
    nonfinite = [
        a
        for a in stack["alerts"]
        if a["labels"]["alertname"] == "TorchvitalsIncident"
        and a["labels"]["kind"] == "nonfinite"
        and a["labels"]["job"] == "vitals"
    ]
    assert len(nonfinite) == 1, stack["alerts"]
    assert nonfinite[0]["labels"]["rank"] == "1"
    assert nonfinite[0]["annotations"]["summary"].startswith("vitals: rank 1 ")
    assert nonfinite[0]["annotations"]["summary"].endswith(" produced the first non-finite value.")
