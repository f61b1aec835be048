"""Many nodes' supervisors around one real etcd: what agreeing through it costs, and how fast a
fault is named and the job restarted.

    python benchmarks/cluster_sim.py --nodes 8 [--cases crash,lost,hang,stopped] [--steady-s 8]
    python benchmarks/cluster_sim.py --nodes 16 --cases crash --json out.json

Starts one etcd on loopback (free ports, a temporary data folder), then, per case, a fresh job
of ``--nodes`` real ``torchvitals supervise`` processes (one job id, ``--store-url``, ``--nnodes``,
``--node-rank``), each around ``sim_job.py``: a torch-free stand-in for torchrun whose ranks
write their heartbeats, stacks, ledger and step lines through the agent's own writers and step in
lockstep every ``--step-s``. Once every rank trains, a steady window of ``--steady-s`` is
measured, then the case's fault is injected at ``--fault-node`` (default the last), at step
``--fault-step`` or the first step after the window:

    crash    a rank exits 13
    lost     the node's supervisor, its launcher and its ranks are SIGKILLed; a replacement
             supervisor for that node is started once the loss is named
    hang     a rank stops stepping and spins outside any collective
    stopped  a rank SIGSTOPs itself

Printed per case: the steady window's etcd requests and gRPC bytes sent per node per second
(etcd's own /metrics: ``grpc_server_started_total``, ``etcd_network_client_grpc_sent_bytes_total``;
the gateway turns every HTTP call into one gRPC call on loopback, so these are the supervisors'
calls; the JSON they receive is larger than the protobuf counted; a supervisor's watch stream
is one long call, counted once when it opens, as ``Watch``, and its events in the bytes sent),
each supervisor's CPU, etcd's
CPU and database size; then the seconds from the fault to the incident that names the culprit
(its ``localized_at``), to every node's next attempt started (its heartbeat folder made) and to
every node's ranks training again (a heartbeat in it); etcd's calls and bytes sent per node from
the fault to every node's next attempt (``inc req/n``, ``inc KiB/n``: the findings, the verdict,
the stop and the start barrier), and how many nodes took another node's verdict instead of
deciding themselves (``took``). The job then finishes cleanly, and nothing
it started is left running: every process carries ``TAG_ENV`` and is looked for afterwards.

A measurement tool: it judges only whether the right culprit was named, every node restarted
and the job then finished (every supervisor exit 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

import torchvitals
from torchvitals.agent.tools.demo.ports import free_ports
from torchvitals.protocol import read_rank_beats
from torchvitals.records.incidents import Incident, IncidentLog
from torchvitals.records.vocabulary import CRASH, HANG, NODE_LOST

HERE = Path(__file__).resolve().parent
SIM_JOB = HERE / "sim_job.py"
sys.path.insert(0, str(HERE))
from sim_job import DONE_FILE, FAULT_FILE, FINISH_FILE  # noqa: E402

CASES = {"crash": CRASH, "lost": NODE_LOST, "hang": HANG, "stopped": HANG}
"""Each case, and the kind of incident that names its culprit."""

TAG_ENV = "TORCHVITALS_CLUSTER_SIM_TAG"
"""Marks every process a run starts (inherited by the supervisors, launchers and ranks)."""

T = TypeVar("T")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, required=True, help="supervisors, one per node")
    p.add_argument("--cases", default="crash", help="comma-separated: " + ",".join(CASES))
    p.add_argument("--steady-s", type=float, default=8.0, help="the measured window (default 8)")
    p.add_argument("--fault-node", type=int, default=None, help="default: the last node")
    p.add_argument("--fault-step", type=int, default=20, help="the earliest fault step")
    p.add_argument("--step-s", type=float, default=0.5, help="seconds a lockstep step takes")
    p.add_argument("--nproc", type=int, default=1, help="ranks per node")
    p.add_argument(
        "--store-poll-s", type=float, default=1.0, help="the supervisors' (default: theirs, 1)"
    )
    p.add_argument("--node-ttl-s", type=float, default=6.0, help="the supervisors' node lease")
    p.add_argument("--poll-s", type=float, default=0.2, help="the supervisors' (default: theirs)")
    p.add_argument("--hang-timeout-s", type=float, default=6.0)
    p.add_argument("--timeout-s", type=float, default=180.0, help="longest wait for any phase")
    p.add_argument("--keep", action="store_true", help="keep the run's folder (logs, records)")
    p.add_argument("--json", default=None, help="also write the results here as JSON")
    args = p.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; known: {','.join(CASES)}")
    if args.fault_node is None:
        args.fault_node = args.nodes - 1
    if not 0 <= args.fault_node < args.nodes:
        p.error(f"--fault-node must be in 0..{args.nodes - 1}")
    return args


def wait_for(what: str, predicate: Callable[[], T | None], timeout_s: float, poll_s=0.1) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout_s:g} s")


# ---------------------------------------------------------------- etcd


def scrape(url: str) -> dict[str, float]:
    """Prometheus text: series (name and labels) -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    out = {}
    for line in lines:
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def total(metrics: dict[str, float], name: str) -> float:
    """The sum over every series of ``name``."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


class Etcd:
    """A one-member etcd on loopback in ``folder``, its metrics on the client URL."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        client = free_ports(2)  # and the next one: the peer port
        peer = client + 1
        self.url, self.peer = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        with open(folder / "etcd.log", "w") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    "--data-dir",
                    str(folder / "etcd-data"),
                    "--listen-client-urls",
                    self.url,
                    "--advertise-client-urls",
                    self.url,
                    "--listen-peer-urls",
                    self.peer,
                    "--initial-advertise-peer-urls",
                    self.peer,
                    "--initial-cluster",
                    f"default={self.peer}",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for("etcd's health", self._healthy, 30, poll_s=0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"
        except OSError:
            return False

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- one job


@dataclass
class Steady:
    """The steady window before the fault, per node where it says so."""

    seconds: float
    requests_per_node_s: float
    """etcd gRPC calls started (the gateway's, one per supervisor HTTP call)."""
    sent_bytes_per_node_s: float
    """Protobuf bytes etcd sent its gRPC clients (the gateway)."""
    received_bytes_per_node_s: float
    supervisor_cpu_pct: float
    """Mean over the nodes' supervisors, % of one core."""
    supervisor_cpu_pct_max: float
    etcd_cpu_pct: float
    db_total_bytes: float
    db_in_use_bytes: float
    requests_by_method: dict[str, float]
    """Per node per second."""


@dataclass
class CaseResult:
    case: str
    nodes: int
    job: str
    steady: Steady | None = None
    fault_at: float | None = None
    incident: dict[str, Any] | None = None
    """The incident that names the culprit (its key, culprit, cause)."""
    expected: dict[str, int] = field(default_factory=dict)
    culprit_ok: bool = False
    name_s: float | None = None
    """Fault to the incident's ``localized_at``."""
    restarted_nodes: int = 0
    restart_s: float | None = None
    """Fault to every node's next attempt started."""
    training_s: float | None = None
    """Fault to every node's ranks beating in it."""
    incident_requests_per_node: float | None = None
    """etcd calls from the fault to every node's next attempt started, per node: the
    detection, the findings, the verdict, the stop and the start barrier."""
    incident_sent_kib_per_node: float | None = None
    """What etcd sent in that window, per node (KiB of protobuf)."""
    verdicts_taken: int = 0
    """Nodes that took another node's verdict rather than deciding themselves (their log's
    "decided by node")."""
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    left_running: list[str] = field(default_factory=list)
    error: str | None = None


class SimJob:
    """``nodes`` supervisors of one job around ``sim_job.py``, in ``folder``."""

    def __init__(self, folder: Path, store_url: str, job: str, args: argparse.Namespace, env):
        self.folder, self.store_url, self.job, self.args = folder, store_url, job, args
        self.ckpt, self.sync, self.control = folder / "ckpt", folder / "sync", folder / "control"
        for f in (self.ckpt, self.sync, self.control):
            f.mkdir(parents=True)
        self.env = {**env, "TORCHVITALS_JOB_ID": job}
        self.procs: dict[int, subprocess.Popen] = {}

    def command(self, node: int) -> list[str]:
        a = self.args
        return [
            sys.executable,
            "-m",
            "torchvitals",
            "supervise",
            "--store-url",
            self.store_url,
            "--nnodes",
            str(a.nodes),
            "--node-rank",
            str(node),
            "--checkpoint-dir",
            str(self.ckpt),
            "--heartbeat-root",
            str(self.root(node)),
            "--node-ttl-s",
            str(a.node_ttl_s),
            "--peer-timeout-s",
            "60",
            "--store-poll-s",
            str(a.store_poll_s),
            "--poll-s",
            str(a.poll_s),
            "--grace-s",
            "3",
            "--backoff-s",
            "0.1",
            "--hang-timeout-s",
            str(a.hang_timeout_s),
            "--startup-timeout-s",
            "90",
            "--metrics-port",
            "0",
            "--",
            sys.executable,
            str(SIM_JOB),
            "--nnodes",
            str(a.nodes),
            "--nproc",
            str(a.nproc),
            "--ckpt",
            str(self.ckpt),
            "--sync",
            str(self.sync),
            "--control",
            str(self.control),
            "--step-s",
            str(a.step_s),
        ]

    def root(self, node: int) -> Path:
        return self.folder / "hb" / f"node{node}"

    def start(self, node: int) -> None:
        with open(self.folder / f"node{node}.log", "a") as log:
            self.procs[node] = subprocess.Popen(
                self.command(node),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def latest(self, node: int) -> int:
        """The newest attempt ``node``'s supervisor started (its heartbeat folder; 0: none)."""
        return max(
            (int(p.name.split("-")[1]) for p in self.root(node).glob("attempt-*")), default=0
        )

    def beating(self, node: int, attempt: int) -> bool:
        """Every rank of ``node`` wrote a heartbeat in ``attempt``."""
        folder = self.root(node) / f"attempt-{attempt:04d}"
        return len(read_rank_beats(folder)) >= self.args.nproc

    def step(self, attempt: int) -> int:
        """The highest step any rank reached in ``attempt`` (its barrier folders)."""
        steps = [int(p.name[1:]) for p in (self.sync / f"a{attempt:04d}").glob("s*")]
        return max(steps, default=0)

    def incident(self, kind: str, attempt: int) -> Incident | None:
        found, _ = IncidentLog(self.ckpt).read()
        named = [i for i in found if i.kind == kind and i.attempt == attempt and i.localized_at]
        return min(named, key=lambda i: i.localized_at or 0.0, default=None)

    def kill_node(self, node: int) -> None:
        """SIGKILL the node's supervisor and everything under it at once (a machine gone)."""
        sup = psutil.Process(self.procs[node].pid)
        tree = [sup, *sup.children(recursive=True)]
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        self.procs[node].wait(10)
        psutil.wait_procs(tree, timeout=10)

    def order(self, name: str, **fields: Any) -> None:
        path = self.control / name
        path.with_suffix(".tmp").write_text(json.dumps(fields))
        path.with_suffix(".tmp").replace(path)

    def done(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.control / DONE_FILE).read_text())
        except (OSError, ValueError):
            return None


def measure(etcd: Etcd, job: SimJob, seconds: float) -> Steady:
    """etcd's counters and every process's CPU over ``seconds``."""
    sups = {n: psutil.Process(p.pid) for n, p in job.procs.items()}
    etcd_proc = psutil.Process(etcd.proc.pid)

    def cpu(proc: psutil.Process) -> float:
        t = proc.cpu_times()
        return t.user + t.system

    before, sup0, etcd0 = scrape(etcd.url), {n: cpu(p) for n, p in sups.items()}, cpu(etcd_proc)
    t0 = time.monotonic()
    time.sleep(seconds)
    after, sup1, etcd1 = scrape(etcd.url), {n: cpu(p) for n, p in sups.items()}, cpu(etcd_proc)
    took = time.monotonic() - t0
    n = len(sups)

    def rate(name: str) -> float:
        return (total(after, name) - total(before, name)) / n / took

    methods: dict[str, float] = {}
    for series, value in after.items():
        if series.startswith("grpc_server_started_total{"):
            method = series.split('grpc_method="', 1)[1].split('"', 1)[0]
            delta = (value - before.get(series, 0.0)) / n / took
            if delta:
                methods[method] = methods.get(method, 0.0) + round(delta, 3)
    sup_pct = [100 * (sup1[k] - sup0[k]) / took for k in sups]
    return Steady(
        seconds=round(took, 2),
        requests_per_node_s=round(rate("grpc_server_started_total"), 3),
        sent_bytes_per_node_s=round(rate("etcd_network_client_grpc_sent_bytes_total"), 1),
        received_bytes_per_node_s=round(rate("etcd_network_client_grpc_received_bytes_total"), 1),
        supervisor_cpu_pct=round(sum(sup_pct) / n, 2),
        supervisor_cpu_pct_max=round(max(sup_pct), 2),
        etcd_cpu_pct=round(100 * (etcd1 - etcd0) / took, 2),
        db_total_bytes=total(after, "etcd_mvcc_db_total_size_in_bytes"),
        db_in_use_bytes=total(after, "etcd_mvcc_db_total_size_in_use_in_bytes"),
        requests_by_method=methods,
    )


def run_case(case: str, etcd: Etcd, root: Path, args: argparse.Namespace, env) -> CaseResult:
    """One job, one fault; every process of it stopped before this returns."""
    job = SimJob(root / case, etcd.url, f"sim-{case}-{uuid.uuid4().hex[:8]}", args, env)
    result = CaseResult(case=case, nodes=args.nodes, job=job.job)
    node, rank = args.fault_node, args.fault_node * args.nproc
    result.expected = {"node": node} if case == "lost" else {"rank": rank}
    try:
        for n in range(args.nodes):
            job.start(n)
        wait_for(
            "every rank training", lambda: all(job.beating(n, 1) for n in job.procs), args.timeout_s
        )
        wait_for("step 2", lambda: job.step(1) >= 2, args.timeout_s)
        result.steady = measure(etcd, job, args.steady_s)
        before = scrape(etcd.url)
        fault_at = result.fault_at = inject(job, case, node, rank, args)
        name(job, result, fault_at, args.timeout_s)
        if case == "lost":
            # The replacement comes once the loss is named: one that joins before the lost
            # node's lease expires makes a new attempt at once, and no node is ever seen lost.
            job.start(node)
        restart(job, result, fault_at, args.timeout_s, on_restart=lambda: window(etcd, before))
        result.verdicts_taken = sum(
            "decided by node" in (job.folder / f"node{n}.log").read_text(errors="replace")
            for n in job.procs
        )
    except (TimeoutError, OSError, psutil.Error) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.left_running = stop_tagged(env[TAG_ENV], keep={etcd.proc.pid})
    return result


def inject(job: SimJob, case: str, node: int, rank: int, args: argparse.Namespace) -> float:
    """The case's fault, at ``args.fault_step`` or two steps on; returns when (unix seconds)."""
    at = max(args.fault_step, job.step(1) + 2)
    if case == "lost":
        wait_for(f"step {at}", lambda: job.step(1) >= at, args.timeout_s, poll_s=0.02)
        fault_at = time.time()
        job.kill_node(node)
        return fault_at
    job.order(FAULT_FILE, case=case, rank=rank, step=at)
    return float(wait_for("the fault", job.done, args.timeout_s)["time"])


def name(job: SimJob, result: CaseResult, fault_at: float, timeout_s: float) -> None:
    """Wait for the incident that names the culprit of attempt 1's fault."""
    kind = CASES[result.case]
    incident = wait_for("the culprit named", lambda: job.incident(kind, 1), timeout_s)
    result.incident = {
        "key": incident.key,
        "culprit": asdict(incident.culprit),
        "cause": incident.cause,
        "rule": incident.evidence.get("rule"),
        "writer": incident.writer,
    }
    result.culprit_ok = all(getattr(incident.culprit, k) == v for k, v in result.expected.items())
    result.name_s = round((incident.localized_at or 0.0) - fault_at, 2)


def window(etcd: Etcd, before: dict[str, float]) -> tuple[float, float]:
    """etcd's calls started and bytes sent since ``before``."""
    after = scrape(etcd.url)
    calls, sent = "grpc_server_started_total", "etcd_network_client_grpc_sent_bytes_total"
    return total(after, calls) - total(before, calls), total(after, sent) - total(before, sent)


def restart(
    job: SimJob,
    result: CaseResult,
    fault_at: float,
    timeout_s: float,
    on_restart: Callable[[], tuple[float, float]],
) -> None:
    """Wait for every node's next attempt and its ranks training, then finish the job."""
    nodes = list(job.procs)
    wait_for("every node's next attempt", lambda: all(job.latest(n) > 1 for n in nodes), timeout_s)
    result.restart_s = round(time.time() - fault_at, 2)
    calls, sent = on_restart()
    result.incident_requests_per_node = round(calls / len(nodes), 1)
    result.incident_sent_kib_per_node = round(sent / len(nodes) / 1024, 2)
    result.restarted_nodes = sum(1 for n in nodes if job.latest(n) > 1)
    wait_for(
        "every node training again",
        lambda: all(job.beating(n, job.latest(n)) for n in nodes),
        timeout_s,
    )
    result.training_s = round(time.time() - fault_at, 2)
    job.order(FINISH_FILE, step=job.step(job.latest(0)) + 3)
    for n in nodes:
        try:
            result.exit_codes[n] = job.procs[n].wait(max(1.0, timeout_s / 3))
        except subprocess.TimeoutExpired:
            result.exit_codes[n] = None


def tagged(tag: str) -> list[psutil.Process]:
    """Processes alive (not zombies) whose environment carries ``tag``."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():  # this simulator, when a caller tagged it
            continue
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(TAG_ENV) == tag:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def stop_tagged(tag: str, keep: set[int]) -> list[str]:
    """Stop every process of ``tag`` but ``keep`` (SIGTERM, SIGKILL after 10 s); returns those
    that were still running when asked (a clean end leaves none)."""
    left = [p for p in tagged(tag) if p.pid not in keep]
    described = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"{proc.pid} {' '.join(proc.cmdline()[:5])}")
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
    _, alive = psutil.wait_procs(left, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=10)
    return described


def print_table(results: list[CaseResult], file=sys.stdout) -> None:
    head = (
        f"{'nodes':>5} {'case':<8} {'req/node/s':>10} {'B/node/s':>9} {'sup CPU%':>8} "
        f"{'etcd CPU%':>9} {'db KiB':>7} {'culprit':<16} {'name s':>6} {'restart s':>9} "
        f"{'train s':>7} {'inc req/n':>9} {'inc KiB/n':>9} {'took':>4} exit"
    )
    print(head, file=file)
    for r in results:
        s = r.steady
        named = "-" if r.incident is None else _who(r.incident["culprit"])
        named += "" if r.culprit_ok else " (WRONG)"
        codes = ",".join(sorted({str(c) for c in r.exit_codes.values()})) or "-"
        print(
            f"{r.nodes:>5} {r.case:<8} "
            + (
                f"{s.requests_per_node_s:>10.2f} {s.sent_bytes_per_node_s:>9.0f} "
                f"{s.supervisor_cpu_pct:>8.2f} {s.etcd_cpu_pct:>9.2f} "
                f"{s.db_total_bytes / 1024:>7.0f} "
                if s is not None
                else f"{'-':>10} {'-':>9} {'-':>8} {'-':>9} {'-':>7} "
            )
            + f"{named:<16} {_num(r.name_s):>6} {_num(r.restart_s):>9} {_num(r.training_s):>7} "
            f"{_num(r.incident_requests_per_node):>9} {_num(r.incident_sent_kib_per_node):>9} "
            f"{r.verdicts_taken:>4} {codes}"
            + (f"  ERROR {r.error}" if r.error else "")
            + (f"  LEFT {len(r.left_running)}" if r.left_running else ""),
            file=file,
        )


def _who(culprit: dict[str, Any]) -> str:
    if culprit.get("rank") is not None:
        return f"rank {culprit['rank']} n{culprit.get('node')}"
    return f"node {culprit.get('node')}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A caller's tag (a test that looks for leftovers itself) is kept.
    tag = os.environ.get(TAG_ENV) or uuid.uuid4().hex
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(torchvitals.__file__)))
    env = {
        **os.environ,
        TAG_ENV: tag,
        "PYTHONPATH": os.pathsep.join(
            p for p in (package_parent, os.environ.get("PYTHONPATH")) if p
        ),
    }
    root = Path(tempfile.mkdtemp(prefix="torchvitals-cluster-sim-"))
    results: list[CaseResult] = []
    etcd = None
    try:
        etcd = Etcd(root, env)
        for case in args.cases.split(","):
            results.append(run_case(case, etcd, root, args, env))
            print_table(results[-1:], file=sys.stderr)
    finally:
        if etcd is not None:
            etcd.close()
        left = [f"{p.pid} {' '.join(p.cmdline()[:5])}" for p in tagged(tag)]
        stop_tagged(tag, keep=set())
        if args.keep:
            print(f"the run's folder: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{args.nodes} nodes x {args.nproc} rank, steps of {args.step_s} s; supervisors: "
        f"--store-poll-s {args.store_poll_s} --node-ttl-s {args.node_ttl_s} --poll-s "
        f"{args.poll_s} --hang-timeout-s {args.hang_timeout_s}; steady window {args.steady_s} s"
    )
    print_table(results)
    if args.json:
        document = {
            "nodes": args.nodes,
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "cases": [asdict(r) for r in results],
            "left_running": left,
        }
        Path(args.json).write_text(json.dumps(document, indent=1))
    ok = all(
        r.error is None
        and r.culprit_ok
        and not r.left_running
        and all(code == 0 for code in r.exit_codes.values())
        for r in results
    )
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
