"""docker/: the compose stack and the images, checked without a Docker engine.

Debian's ``docker-compose config`` resolves compose.yaml (paths, interpolation, schema);
the Prometheus and Alertmanager configs are checked by promtool and amtool on a copy of the
files each container would see, built from the service's bind mounts; the Dockerfiles are
parsed for the properties the images must have, and their HEALTHCHECK commands are run against
a real collector.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
SERVICES = {"token", "torchvitals-collector", "trainer", "prometheus", "alertmanager", "grafana"}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (CI installs it: see docs/deploy.md)")
    return path


@pytest.fixture(scope="module")
def compose() -> dict:
    """compose.yaml as docker-compose resolves it (absolute host paths, defaults filled in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    proc = subprocess.run(
        [_tool("docker-compose"), "-f", str(DOCKER / "compose.yaml"), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def bind_mounts(service: dict) -> list[tuple[Path, PurePosixPath]]:
    """(host path, container path) of each bind mount of a resolved service."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("/"):
            mounts.append((Path(source), PurePosixPath(target)))
    return mounts


def container_view(service: dict, root: Path) -> Path:
    """Copy what a service's bind mounts show into ``root`` as the container would see it."""
    for source, target in bind_mounts(service):
        assert source.exists(), f"bind mount source {source} does not exist"
        dest = root / target.relative_to("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, dest)
        else:
            shutil.copyfile(source, dest)
    return root


def host_path(service: dict, container_path: str) -> Path | None:
    """The host path a container path of ``service`` maps to through its bind mounts."""
    path = PurePosixPath(container_path)
    for source, target in bind_mounts(service):
        if path == target or target in path.parents:
            return source / path.relative_to(target)
    return None


def named_volume_of(service: dict, container_path: str) -> str | None:
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if not source.startswith("/") and (
            container_path == target or container_path.startswith(target + "/")
        ):
            return source
    return None


def test_compose_file_resolves_with_every_service(compose):
    assert set(compose["services"]) == SERVICES
    for name, service in compose["services"].items():
        if "build" in service:
            dockerfile = Path(service["build"]["context"]) / service["build"]["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        else:
            # Third-party images are pinned to a release, never :latest.
            assert re.search(r":v?\d+\.\d+\.\d+$", service["image"]), service["image"]
        for port in service.get("ports", []):
            published = port if isinstance(port, str) else port.get("host_ip", "")
            assert "127.0.0.1" in str(published), f"{name} publishes {port} beyond localhost"


def test_prometheus_config_passes_promtool_with_the_canonical_rules(compose, tmp_path):
    service = compose["services"]["prometheus"]
    flag = next(a for a in service["command"] if a.startswith("--config.file="))
    config_path = flag.split("=", 1)[1]
    root = container_view(service, tmp_path)
    config = root / config_path.lstrip("/")
    proc = subprocess.run(
        [_tool("promtool"), "check", "config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    canonical = sorted((ROOT / "grafana" / "rules").glob("*.rules.yml"))
    assert f"SUCCESS: {len(canonical)} rule files found" in proc.stdout + proc.stderr
    assert canonical, "grafana/rules holds no rule file"


def test_prometheus_scrapes_every_rank_of_the_trainer_under_its_collector_job(compose):
    prometheus = compose["services"]["prometheus"]
    config = yaml.safe_load(host_path(prometheus, "/etc/prometheus/prometheus.yml").read_text())
    trainer = compose["services"]["trainer"]
    command = trainer["command"]
    nproc = int(command[command.index("--nproc-per-node") + 1])
    job_name = trainer["environment"]["TORCHVITALS_COLLECTOR_JOB"]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == job_name]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    base = 19400  # the trainer image's TORCHVITALS_METRICS_PORT, the agent's default
    assert targets == [f"trainer:{base + rank}" for rank in range(nproc)]
    assert "TORCHVITALS_METRICS_PORT=19400" in (DOCKER / "trainer.Dockerfile").read_text()
    script = next(a for a in command if a.endswith(".py"))
    assert script.startswith("/app/examples/")
    assert (ROOT / "examples" / PurePosixPath(script).name).is_file()


def test_alertmanager_config_passes_amtool_and_reaches_the_collector(compose, tmp_path):
    service = compose["services"]["alertmanager"]
    flag = next(a for a in service["command"] if a.startswith("--config.file="))
    root = container_view(service, tmp_path)
    config_file = root / flag.split("=", 1)[1].lstrip("/")
    proc = subprocess.run(
        [_tool("amtool"), "check-config", str(config_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load(config_file.read_text())
    webhooks = [w for r in config["receivers"] for w in r.get("webhook_configs", [])]
    collector = compose["services"]["torchvitals-collector"]
    to_collector = [w for w in webhooks if urlsplit(w["url"]).hostname in compose["services"]]
    assert to_collector, "no webhook reaches a compose service"
    for webhook in to_collector:
        url = urlsplit(webhook["url"])
        assert compose["services"][url.hostname] is collector
        # The collector image's TORCHVITALS_COLLECTOR_PORT; POST /alerts is the webhook.
        assert (url.port, url.path) == (9500, "/alerts")
    assert "TORCHVITALS_COLLECTOR_PORT=9500" in (DOCKER / "collector.Dockerfile").read_text()
    token_file = collector["environment"]["TORCHVITALS_WEBHOOK_TOKEN_FILE"]
    for webhook in to_collector:
        credentials = webhook["http_config"]["authorization"]["credentials_file"]
        # Alertmanager reads the token from the same volume the collector reads it from.
        assert named_volume_of(service, credentials) == named_volume_of(collector, token_file)
        assert PurePosixPath(credentials).name == PurePosixPath(token_file).name


def test_grafana_provisioning_points_at_the_dashboards_and_prometheus(compose):
    grafana = compose["services"]["grafana"]
    providers_dir = host_path(grafana, "/etc/grafana/provisioning/dashboards")
    assert providers_dir is not None and providers_dir.is_dir()
    canonical = {p.name for p in (ROOT / "grafana" / "dashboards").glob("*.json")}
    assert canonical, "grafana/dashboards holds no dashboard"
    provided = set()
    for provider_file in sorted(providers_dir.glob("*.y*ml")):
        for provider in yaml.safe_load(provider_file.read_text())["providers"]:
            folder = host_path(grafana, provider["options"]["path"])
            assert folder is not None and folder.is_dir(), (
                f"{provider_file.name}: {provider['options']['path']} is not mounted"
            )
            provided |= {p.name for p in folder.glob("*.json")}
    assert provided == canonical
    datasources_dir = host_path(grafana, "/etc/grafana/provisioning/datasources")
    urls = [
        d["url"]
        for f in sorted(datasources_dir.glob("*.y*ml"))
        for d in yaml.safe_load(f.read_text())["datasources"]
        if d["type"] == "prometheus"
    ]
    assert urls and all(u.rstrip("/") == "http://prometheus:9090" for u in urls)
    for name in canonical:
        json.loads((ROOT / "grafana" / "dashboards" / name).read_text())


def dockerfile_stages(path: Path) -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), one list per FROM stage."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stages.append([])
        stages[-1].append((keyword, args.strip()))
    return stages


def _args(stage, keyword):
    return [args for k, args in stage if k == keyword]


@pytest.mark.parametrize("name", ["collector.Dockerfile", "trainer.Dockerfile"])
def test_images_are_multi_stage_non_root_with_healthcheck_and_pinned_torch(name):
    stages = dockerfile_stages(DOCKER / name)
    build, final = stages[1], stages[-1]
    assert len(stages) - 1 >= 2, "multi-stage"
    assert any("--from=build" in c for c in _args(final, "COPY"))
    (user,) = _args(final, "USER")
    assert user.split(":")[0] not in ("0", "root") and int(user.split(":")[0]) >= 1000
    (healthcheck,) = _args(final, "HEALTHCHECK")
    assert "CMD" in healthcheck
    # Nothing is built or installed in the final stage, and the installers left the venv.
    assert not any(re.search(r"pip |apt-get|apk |gcc|make", r) for r in _args(final, "RUN"))
    assert any("pip uninstall --yes pip setuptools" in r for r in _args(build, "RUN"))
    torch_pin = re.search(
        r'^\s*"(torch[<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
    ).group(1)
    torch_runs = [r for r in _args(build, "RUN") if f'"{torch_pin}"' in r]
    if name == "collector.Dockerfile":
        # The collector imports no torch: every other dependency, then the package alone.
        assert not torch_runs and "TORCH_INDEX_URL" not in (DOCKER / name).read_text()
        assert any(
            "collector-requirements.py" in r and "pip install --no-deps ." in r
            for r in _args(build, "RUN")
        )
    else:
        assert torch_runs and all("--index-url" in r for r in torch_runs)
        assert (
            "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
            in (DOCKER / name).read_text()
        )
    ignored = (ROOT / ".dockerignore").read_text().split()
    for stage in stages[1:]:
        for copy in _args(stage, "COPY"):
            if copy.startswith("--from"):
                continue
            for source in shlex.split(copy)[:-1]:
                assert (ROOT / source).exists(), f"{name} copies {source}, which is missing"
                assert any(
                    source.rstrip("/") == i.lstrip("!").rstrip("/")
                    or source.startswith(i.lstrip("!").rstrip("/") + "/")
                    for i in ignored
                    if i.startswith("!")
                ), f"{source} is excluded from the build context by .dockerignore"
    # The package is whole in the image: every top-level module and every package pyproject
    # lists (a module the build leaves out installs fine and fails at its first import).
    copied = {
        source.rstrip("/")
        for copy in _args(build, "COPY")
        if not copy.startswith("--from")
        for source in shlex.split(copy)[:-1]
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.split(".")[1] for p in project["tool"]["setuptools"]["packages"] if "." in p}
    missing = sorted(({p.name for p in ROOT.glob("*.py")} | packages) - copied)
    assert not missing, f"{name} does not copy {missing} into the package it installs"


def test_collector_image_runs_the_collector_and_trainer_image_runs_the_supervisor():
    collector = dockerfile_stages(DOCKER / "collector.Dockerfile")[-1]
    assert _args(collector, "ENTRYPOINT") == ['["torchvitals-collector"]']
    assert "TORCHVITALS_COLLECTOR_HOST=0.0.0.0" in " ".join(_args(collector, "ENV"))
    trainer = dockerfile_stages(DOCKER / "trainer.Dockerfile")[-1]
    (cmd,) = _args(trainer, "CMD")
    cmd = json.loads(cmd)
    assert cmd[:2] == ["torchvitals", "supervise"] and cmd[cmd.index("--") + 1] == "torchrun"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'torchvitals-collector = "torchvitals.collector.__main__:main"' in pyproject
    assert 'torchvitals = "torchvitals.__main__:main"' in pyproject


def _healthcheck(name: str) -> list[str]:
    (hc,) = _args(dockerfile_stages(DOCKER / name)[-1], "HEALTHCHECK")
    command = json.loads(hc[hc.index("CMD") + 3 :].strip())
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


def test_collector_healthcheck_passes_on_a_live_collector_and_fails_without_one(tmp_path):
    from torchvitals.collector import CollectorConfig, CollectorServer

    server = CollectorServer(
        CollectorConfig(
            port=0, state_dir=str(tmp_path / "state"), webhook_token="t" * 16, access_log=False
        )
    ).start()
    try:
        env = {**os.environ, "TORCHVITALS_COLLECTOR_PORT": str(server.port)}
        ok = subprocess.run(
            _healthcheck("collector.Dockerfile"), env=env, capture_output=True, timeout=30
        )
        assert ok.returncode == 0, ok.stderr
    finally:
        server.stop()
    down = subprocess.run(
        _healthcheck("collector.Dockerfile"), env=env, capture_output=True, timeout=30
    )
    assert down.returncode != 0


def test_trainer_healthcheck_reads_rank_zero_metrics(tmp_path):
    from prometheus_client import CollectorRegistry, start_http_server

    server, thread = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        env = {**os.environ, "TORCHVITALS_METRICS_PORT": str(server.server_port)}
        ok = subprocess.run(
            _healthcheck("trainer.Dockerfile"), env=env, capture_output=True, timeout=30
        )
        assert ok.returncode == 0, ok.stderr
    finally:
        server.shutdown()
        thread.join(10)


def test_the_trainer_holds_its_own_token_and_the_collector_accepts_it_for_its_job_only(
    compose, tmp_path
):
    services = compose["services"]
    token, collector, trainer = (services[n] for n in ("token", "torchvitals-collector", "trainer"))
    job = trainer["environment"]["TORCHVITALS_COLLECTOR_JOB"]
    assert token["environment"]["TORCHVITALS_COLLECTOR_JOB"] == job
    # The trainer never mounts the volume of Alertmanager's token (which may post alerts).
    webhook_file = collector["environment"]["TORCHVITALS_WEBHOOK_TOKEN_FILE"]
    assert named_volume_of(collector, webhook_file) not in {
        v.split(":")[0] for v in trainer["volumes"]
    }
    # Run the token service's script with its volumes as folders here, twice (a restart).
    script = token["entrypoint"][2]
    for volume in token["volumes"]:
        name, target = volume.split(":")[:2]
        (tmp_path / name).mkdir(exist_ok=True)
        script = script.replace(f'"{target}/', f'"{tmp_path / name}/').replace(
            f'f"{target}/', f'f"{tmp_path / name}/'
        )
    for _ in range(2):
        subprocess.run(
            [sys.executable, "-c", script],
            check=True,
            timeout=60,
            env={**os.environ, **token["environment"]},
        )

    def here(service, path):
        return tmp_path / named_volume_of(service, path) / PurePosixPath(path).name

    from torchvitals.collector.auth import Tokens

    webhook = here(collector, webhook_file).read_text().strip()
    tokens = Tokens(
        webhook,
        job_tokens_file=str(
            here(collector, collector["environment"]["TORCHVITALS_COLLECTOR_JOB_TOKENS_FILE"])
        ),
    )
    mine = here(trainer, trainer["environment"]["TORCHVITALS_WEBHOOK_TOKEN_FILE"]).read_text()
    principal = tokens.identify(f"Bearer {mine.strip()}")
    assert (principal.kind, principal.job) == ("job", job)
    assert tokens.identify(f"Bearer {webhook}").kind == "alertmanager"
    assert mine.strip() != webhook
