"""Two simulated nodes on loopback for the multi-node tests: a real etcd, and per node a
``torchvitals supervise`` wrapping a real torchrun agent (c10d rendezvous, gloo ranks: one per
node unless told).

    with Etcd(tmp_path) as etcd:
        nodes = Cluster(tmp_path, etcd.url, job="job-a", fault="kill")
        nodes.start(); nodes.wait()

Every process a scenario starts carries ``TAG_ENV`` in its environment, so ``leftovers`` finds
any of them still running afterwards, however it was started.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
from support.ports import free_port

HERE = Path(__file__).resolve().parent
JOB = HERE / "node_job.py"
ROOT = HERE.parents[1]
PYTHONPATH = os.pathsep.join(p for p in (str(ROOT.parent), os.environ.get("PYTHONPATH")) if p)
PASSWORDS = {"root": uuid.uuid4().hex, "supervisor": uuid.uuid4().hex}
"""The users of the authenticated etcd the tests start (``conftest.auth_etcd``)."""
TAG_ENV, NODE_ENV = "MULTINODE_TEST_TAG", "MULTINODE_TEST_NODE"
"""Mark every process of a scenario, and of which node (inherited by the launcher and ranks)."""
SKEWED_CLOCK = HERE / "skewed_clock"
SKEW_ENV = "MULTINODE_TEST_CLOCK_SKEW_S"
"""A node's wall clock is this many seconds off the machine's (``skewed_clock/sitecustomize``)."""


@dataclass(frozen=True)
class Certs:
    """A throwaway CA, etcd's server certificate (127.0.0.1) and client certificates, PEM files
    in one folder: ``client`` signed by the CA; ``stranger`` by another CA etcd does not trust.
    No certificate carries a Common Name: with auth on, etcd's gateway refuses a client
    certificate that has one, and it presents the server's as its own client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path

    @classmethod
    def make(cls, folder: Path) -> Certs:
        openssl = shutil.which("openssl")
        if openssl is None:
            raise RuntimeError("openssl is not installed (Debian: apt-get install openssl)")
        folder.mkdir(parents=True, exist_ok=True)

        def run(*args: str) -> None:
            subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

        def key_and_csr(name: str) -> None:
            run(
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                "/",
                "-keyout",
                str(folder / f"{name}.key"),
                "-out",
                str(folder / f"{name}.csr"),
            )

        for ca in ("ca", "other-ca"):
            run(
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "1",
                "-subj",
                f"/CN=torchvitals test {ca}",
                "-keyout",
                str(folder / f"{ca}.key"),
                "-out",
                str(folder / f"{ca}.crt"),
            )
        for name, ca, ext in [
            (
                "server",
                "ca",
                "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
            ),
            (
                "client",
                "ca",
                "subjectAltName=DNS:torchvitals-supervisor\nextendedKeyUsage=clientAuth\n",
            ),
            (
                "stranger",
                "other-ca",
                "subjectAltName=DNS:torchvitals-supervisor\nextendedKeyUsage=clientAuth\n",
            ),
        ]:
            key_and_csr(name)
            (folder / f"{name}.ext").write_text(ext)
            run(
                "x509",
                "-req",
                "-in",
                str(folder / f"{name}.csr"),
                "-CA",
                str(folder / f"{ca}.crt"),
                "-CAkey",
                str(folder / f"{ca}.key"),
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                str(folder / f"{name}.ext"),
                "-out",
                str(folder / f"{name}.crt"),
            )
        return cls(
            ca=folder / "ca.crt",
            server_cert=folder / "server.crt",
            server_key=folder / "server.key",
            client_cert=folder / "client.crt",
            client_key=folder / "client.key",
            stranger_cert=folder / "stranger.crt",
            stranger_key=folder / "stranger.key",
        )


class Etcd:
    """A one-member etcd on loopback, in ``folder``.

    Args:
        certs: serve https only, and only to clients whose certificate the CA signed
            (``--client-cert-auth``).
        args: more etcd flags (``--auth-token-ttl 1``).
    """

    def __init__(self, folder: Path, *, certs: Certs | None = None, args=()) -> None:
        self.folder, self.certs, self.args = folder, certs, list(args)
        self.client, self.peer = free_port(), free_port()
        scheme = "https" if certs else "http"
        self.url = f"{scheme}://127.0.0.1:{self.client}"
        self.proc: subprocess.Popen | None = None

    def context(self) -> ssl.SSLContext | None:
        """A client context with the trusted client certificate (None: plain http)."""
        if self.certs is None:
            return None
        context = ssl.create_default_context(cafile=str(self.certs.ca))
        context.load_cert_chain(str(self.certs.client_cert), str(self.certs.client_key))
        return context

    def __enter__(self) -> Etcd:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        peer = f"http://127.0.0.1:{self.peer}"
        tls = (
            []
            if self.certs is None
            else [
                "--cert-file",
                str(self.certs.server_cert),
                "--key-file",
                str(self.certs.server_key),
                "--trusted-ca-file",
                str(self.certs.ca),
                "--client-cert-auth",
            ]
        )
        self.log = open(self.folder / "etcd.log", "w")
        self.proc = subprocess.Popen(
            [
                binary,
                "--data-dir",
                str(self.folder / "etcd-data"),
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"default={peer}",
                *tls,
                *self.args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                    self.url + "/health", timeout=1, context=self.context()
                ) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return self
            except OSError:
                time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"etcd did not start: {(self.folder / 'etcd.log').read_text()[-2000:]}")

    def call(self, path: str, body: dict, token: str | None = None) -> dict:
        """One gateway call as an administrator would make it (the test's own, not the
        client's under test)."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers=headers
        )
        with urllib.request.urlopen(request, timeout=5, context=self.context()) as r:
            return json.loads(r.read() or b"{}")

    def enable_auth(self, users: dict[str, str], prefix: str = "torchvitals/jobs/") -> None:
        """Turn etcd's authentication on, as etcdctl's ``auth enable`` does: a root user with
        the root role, then every other user with a role that may read and write ``prefix``."""
        import base64

        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        for name, password in users.items():
            self.call("/v3/auth/user/add", {"name": name, "password": password})
            role = "root" if name == "root" else f"{name}-jobs"
            self.call("/v3/auth/role/add", {"name": role})
            if role != "root":
                self.call(
                    "/v3/auth/role/grant",
                    {
                        "name": role,
                        "perm": {
                            "permType": "READWRITE",
                            "key": b64(prefix),
                            "range_end": b64(end),
                        },
                    },
                )
            self.call("/v3/auth/user/grant", {"user": name, "role": role})
        self.call("/v3/auth/enable", {})

    def __exit__(self, *exc) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


class Cluster:
    """Two nodes of one job sharing ``tmp_path / "ckpt"``; each node's supervisor logs to
    ``tmp_path / f"node{i}.log"`` and keeps its heartbeats under ``tmp_path / "hb" / f"node{i}"``.

    Args:
        supervise: extra ``torchvitals supervise`` flags.
        metrics_port: node 0's supervisor's /metrics port (0: none).
        torchrun: extra torchrun flags.
        job_args: extra flags of the job script.
        script: the job torchrun starts on each node (default ``node_job.py``).
        nproc_per_node: ranks per node (torchrun's ``--nproc-per-node``).
        timeouts: pass the short hang and startup timeouts a test on loopback can afford;
            False leaves the supervisor's defaults (its learned bounds).
        skew: seconds each node's wall clock is off the machine's (its supervisor, launcher
            and ranks alike; default none).
    """

    def __init__(
        self,
        tmp_path: Path,
        store_url: str,
        job: str,
        *,
        supervise=(),
        torchrun=(),
        job_args=(),
        metrics_port: int = 0,
        script: Path = JOB,
        nproc_per_node: int = 1,
        timeouts: bool = True,
        skew: dict[int, float] | None = None,
    ) -> None:
        self.tmp, self.store_url, self.job = tmp_path, store_url, job
        self.rdzv = free_port()
        self.tag = uuid.uuid4().hex
        self.ckpt, self.out = tmp_path / "ckpt", tmp_path / "out.jsonl"
        self.supervise, self.torchrun, self.job_args = (
            list(supervise),
            list(torchrun),
            list(job_args),
        )
        self.command_nnodes = "2"
        """torchrun's ``--nnodes`` (``1:2``: the job may go on with one node)."""
        self.metrics_port = metrics_port
        """Node 0's supervisor serves /metrics here (0: not)."""
        self.script, self.nproc_per_node, self.timeouts = script, nproc_per_node, timeouts
        self.skew = dict(skew or {})
        self.procs: dict[int, subprocess.Popen] = {}
        self.runs = 0

    def command(self, node: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torchvitals",
            "supervise",
            "--store-url",
            self.store_url,
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--checkpoint-dir",
            str(self.ckpt),
            "--heartbeat-root",
            str(self.tmp / "hb" / f"node{node}"),
            "--node-ttl-s",
            "3",
            "--peer-timeout-s",
            "10",
            "--store-poll-s",
            "0.2",
            "--poll-s",
            "0.1",
            "--grace-s",
            "3",
            "--backoff-s",
            "0.1",
            *(["--hang-timeout-s", "8", "--startup-timeout-s", "90"] if self.timeouts else []),
            "--metrics-port",
            str(self.metrics_port if node == 0 else 0),
            *self.supervise,
            "--",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            self.command_nnodes,
            "--nproc-per-node",
            str(self.nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{self.rdzv}",
            "--rdzv-id",
            self.job,
            "--monitor-interval",
            "0.2",
            *self.torchrun,
            str(self.script),
            "--ckpt",
            str(self.ckpt),
            "--out",
            str(self.out),
            *self.job_args,
        ]

    def start(self, node: int | None = None) -> None:
        """Start both nodes' supervisors (or one: a replaced node)."""
        env = {
            **os.environ,
            "PYTHONPATH": PYTHONPATH,
            TAG_ENV: self.tag,
            "TORCHVITALS_JOB_ID": self.job,
            "OMP_NUM_THREADS": "1",
        }
        for n in [0, 1] if node is None else [node]:
            self.runs += 1
            clock = {}
            if self.skew.get(n):
                clock = {
                    "PYTHONPATH": os.pathsep.join((str(SKEWED_CLOCK), PYTHONPATH)),
                    SKEW_ENV: repr(self.skew[n]),
                }
            with open(self.tmp / f"node{n}.log", "a") as log:
                self.procs[n] = subprocess.Popen(
                    self.command(n),
                    env={**env, NODE_ENV: str(n), **clock},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

    def wait(self, timeout: float = 150) -> dict[int, int]:
        """Every node's supervisor's exit status."""
        deadline = time.monotonic() + timeout
        return {n: p.wait(max(1.0, deadline - time.monotonic())) for n, p in self.procs.items()}

    def log(self, node: int) -> str:
        return (self.tmp / f"node{node}.log").read_text(errors="replace")

    def records(self, event: str | None = None) -> list[dict]:
        if not self.out.exists():
            return []
        lines = [json.loads(line) for line in self.out.read_text().splitlines() if line]
        return [r for r in lines if event is None or r["event"] == event]

    def attempts(self, node: int) -> list[str]:
        return sorted(p.name for p in (self.tmp / "hb" / f"node{node}").iterdir())

    def last_healthy(self) -> int | None:
        try:
            ledger = json.loads((self.ckpt / "ledger.json").read_text())
        except (OSError, ValueError):
            return None
        steps = [e["step"] for e in ledger["entries"] if e["event"] == "checkpoint"]
        return steps[-1] if steps else None

    def processes(self, node: int | None = None) -> list[psutil.Process]:
        """This scenario's processes still running (of one node: its supervisor's tree)."""
        found = []
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
                if (
                    env.get(TAG_ENV) == self.tag
                    and proc.status() != psutil.STATUS_ZOMBIE
                    and (node is None or env.get(NODE_ENV) == str(node))
                ):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def stop_all(self) -> None:
        """Kill whatever is left (after a failed assertion), so no test leaks processes."""
        for proc in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
