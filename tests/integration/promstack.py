"""Real Prometheus and Alertmanager servers on loopback for the integration tests.

Debian's packages provide the binaries (``apt-get install prometheus prometheus-alertmanager``;
``.ci/run`` installs them). A missing binary fails the test: CI has them, so a skip would only
hide a broken set-up.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.world import free_port

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "grafana" / "rules" / "torchvitals.rules.yml"
RULE_TESTS = REPO / "grafana" / "rules" / "tests.yml"
DASHBOARDS = REPO / "grafana" / "dashboards"
ALERTMANAGER_CONFIG = REPO / "grafana" / "alertmanager" / "alertmanager.yml"


def require(*names: str) -> str:
    """The path of the first binary of ``names`` on PATH; fails the test when none is."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        f"{' or '.join(names)} not found: install Debian's prometheus and "
        f"prometheus-alertmanager packages (.ci/run does)",
        pytrace=False,
    )


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


class Server:
    """A server process with its log in ``workdir``; ``stop`` ends it."""

    def __init__(
        self, argv: list[str], workdir: Path, name: str, port: int, ready_path: str
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.name = name
        self.log = workdir / f"{name}.log"
        self._log_file = open(self.log, "wb")  # noqa: SIM115 (the server's output; stop() closes it)
        self.proc = subprocess.Popen(
            argv, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=workdir
        )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"{name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + ready_path, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{name} not ready after 30 s:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log_file.close()


class Prometheus(Server):
    """Prometheus scraping ``jobs`` (name -> targets) and ``file_sd`` (name -> a glob of target
    files) every second, evaluating ``rule_files`` every second and sending alerts to
    ``alertmanager`` (a URL) when given."""

    def __init__(
        self,
        workdir: Path,
        jobs: dict[str, list[str]],
        rule_files: list[Path],
        alertmanager: str | None = None,
        file_sd: dict[str, str] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "global": {
                "scrape_interval": "1s",
                "evaluation_interval": "1s",
                "scrape_timeout": "900ms",
            },
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]}
                for job, targets in jobs.items()
            ]
            # job -> a glob of file_sd target files (the agents' metrics_file_sd_dir)
            + [
                {"job_name": job, "file_sd_configs": [{"files": [glob], "refresh_interval": "1s"}]}
                for job, glob in (file_sd or {}).items()
            ],
        }
        if alertmanager:
            config["alerting"] = {
                "alertmanagers": [
                    {"static_configs": [{"targets": [urllib.parse.urlparse(alertmanager).netloc]}]}
                ]
            }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        super().__init__(
            [
                require("prometheus"),
                "--config.file=prometheus.yml",
                "--storage.tsdb.path=data",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            workdir,
            "prometheus",
            port,
            "/-/ready",
        )

    def query(self, expr: str, **params: Any) -> list[dict]:
        """An instant query's result vector."""
        body = get_json(
            f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr, **params})
        )
        assert body["status"] == "success", body
        return body["data"]["result"]

    def query_range(self, expr: str, seconds: float, step: str = "1s") -> list[dict]:
        """A range query over the last ``seconds``; raises on a PromQL error."""
        end = time.time()
        body = get_json(
            f"{self.url}/api/v1/query_range?"
            + urllib.parse.urlencode(
                {"query": expr, "start": end - seconds, "end": end, "step": step}
            )
        )
        assert body["status"] == "success", body
        return body["data"]["result"]

    def alerts(self) -> list[dict]:
        return get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"]


class Alertmanager(Server):
    """Alertmanager with ``config`` (a dict), clustering off, on a free loopback port."""

    def __init__(self, workdir: Path, config: dict) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        super().__init__(
            [
                require("prometheus-alertmanager", "alertmanager"),
                "--config.file=alertmanager.yml",
                "--storage.path=data",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            workdir,
            "alertmanager",
            port,
            "/-/ready",
        )
