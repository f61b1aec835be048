"""The package's shape holds: stages import only what comes before them, nothing imports in a
cycle, each wire contract is spelled once, the torch-free commands run where torch cannot be
imported, and every command's --help explains its flags."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchvitals
from torchvitals import protocol
from torchvitals.collector.config import CollectorConfig
from torchvitals.collector.supervisor.config import SupervisorConfig
from torchvitals.settings import field_docs

ROOT = Path(torchvitals.__file__).resolve().parent
STAGES = {"measure": 1, "detect": 2, "recover": 3, "outputs": 4, "tools": 5, "integrations": 5}
"""Each stage of agent/ may import only the stages up to its own."""
LEAVES = {"torchvitals.agent.detect.verdict", "torchvitals.agent.detect.thresholds"}
"""Plain data every stage may import: the pattern table, the thresholds."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "benchmarks", "examples", "helm", "docker", "build"):
            continue
        parts = ("torchvitals", *rel.with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules ``name`` imports anywhere in its body (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        out |= {c for c in candidates if c in MODULES and c != name}
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _stage(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "agent" and parts[2] in STAGES:
        return STAGES[parts[2]]
    return None


def test_no_stage_imports_a_later_one():
    wrong = []
    for module, targets in GRAPH.items():
        mine = _stage(module)
        for target in targets - LEAVES:
            theirs = _stage(target)
            if theirs is None:
                if target in ("torchvitals.agent.agent", "torchvitals.agent.guard") and \
                        mine not in (None, STAGES["tools"]):
                    wrong.append((module, target))
                continue
            if mine is None and module.startswith("torchvitals.agent.") and module not in (
                    "torchvitals.agent.agent", "torchvitals.agent.step") and \
                    not module.startswith("torchvitals.agent.signals."):
                wrong.append((module, target))         # config/report are below every stage
            elif mine is not None and theirs > mine:
                wrong.append((module, target))
    assert not wrong, wrong


STEP_STAGES = {"pack": "measure", "reduce": "reduce", "unpack": "reduce", "observe": "detect",
               "real_step": "act", "rollback": "act", "maybe_save": "act", "publish": "publish"}
"""The calls that make up one step, by the stage they belong to."""


def test_the_step_stages_are_called_from_one_place():
    """One step reads top to bottom in ``Steps.run``: every stage of the step (a signal's pack
    and unpack, the reduction, the detector, the real optimizer step, the watchdog's save and
    rollback, the sinks) is called from ``agent/step.py`` and nowhere else in the agent."""
    calls: dict[str, set[str]] = {}
    receivers = {"signal", "reducer", "detector", "guard", "watchdog", "outputs"}
    for name, path in MODULES.items():
        if not name.startswith("torchvitals.agent.") or ".tools." in name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in STEP_STAGES):
                continue
            owner = node.func.value
            owner = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if owner in receivers:
                calls.setdefault(f"{owner}.{node.func.attr}", set()).add(name)
    assert {"signal.pack", "signal.unpack", "reducer.reduce", "detector.observe",
            "guard.real_step", "watchdog.rollback", "watchdog.maybe_save",
            "outputs.publish"} <= set(calls), calls
    elsewhere = {call: sorted(m - {"torchvitals.agent.step"}) for call, m in calls.items()
                 if m - {"torchvitals.agent.step"}}
    assert not elsewhere, elsewhere
    source = (ROOT / "agent" / "step.py").read_text()
    run = source[source.index("    def run(self, inp: StepInput)"):]
    run = run[:run.index("\n    def ", 10)]
    order = [run.index(f"# {stage}") for stage in ("measure", "reduce", "detect", "decide and act",
                                                   "publish")]
    assert order == sorted(order), "Steps.run reads measure, reduce, detect, decide/act, publish"


def test_every_signal_names_real_rules_and_metrics():
    """A signal's declared rules and metric families exist: the slice's map stays true."""
    import importlib
    import inspect
    from torchvitals.agent.detect import rules, rules_vitals, straggler
    from torchvitals.agent.detect.verdict import COLLECTOR_DIRECTIVE
    from torchvitals.agent.outputs import metrics
    from torchvitals.agent.signals.base import Signal
    rule_names = {n for mod in (rules, rules_vitals, straggler) for n, _ in
                  inspect.getmembers(mod, inspect.isclass)} | {COLLECTOR_DIRECTIVE}
    metric_source = inspect.getsource(metrics)
    found = []
    for path in sorted((ROOT / "agent" / "signals").glob("*.py")):
        module = importlib.import_module(f"torchvitals.agent.signals.{path.stem}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Signal) and cls is not Signal and cls.__module__ == module.__name__:
                found.append(cls)
                assert set(cls.rules) <= rule_names, (cls, set(cls.rules) - rule_names)
                assert all(f'"{m}"' in metric_source for m in cls.metrics), cls
    assert len(found) == 11, [c.__name__ for c in found]


def test_no_import_cycle_anywhere():
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            # A package's lazy __getattr__ names its modules as strings, not imports: no edge.
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_the_collector_reaches_into_the_agent_only_for_the_ledger():
    for module, targets in GRAPH.items():
        if module.startswith("torchvitals.collector"):
            into_agent = {t for t in targets if t.startswith("torchvitals.agent")}
            assert into_agent <= {"torchvitals.agent", "torchvitals.agent.recover",
                                  "torchvitals.agent.recover.ledger",
                                  "torchvitals.agent.recover.durable",
                                  "torchvitals.agent.recover.jobid"}, (module, into_agent)


@pytest.mark.parametrize("literal", ["torchvitals_action", "ledger.json", "aborted",
                                     "TORCHVITALS_HEARTBEAT_DIR", "TORCHVITALS_WEBHOOK_TOKEN",
                                     "TORCHVITALS_WEBHOOK_TOKEN_FILE", "TORCHVITALS_SUPERVISOR_ATTEMPT"])
def test_each_wire_contract_is_spelled_once(literal):
    """The literal lives in protocol.py; every other module imports the name."""
    spelled = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value == literal
                    and id(node) not in docstrings):
                spelled.append(module)
    assert set(spelled) <= {"torchvitals.protocol"}, spelled
    assert literal in {v for v in vars(protocol).values() if isinstance(v, str)}


def test_every_error_raised_on_purpose_shares_one_base():
    from torchvitals.agent.outputs.exporter import MetricsPortError
    from torchvitals.agent.recover.checkpoint import CheckpointError
    from torchvitals.agent.recover.ledger import LedgerError
    from torchvitals.collector.webhook import PayloadError
    from torchvitals.protocol import TokenError
    for cls in (MetricsPortError, CheckpointError, LedgerError, PayloadError, TokenError,
                torchvitals.TrainingAborted):
        assert issubclass(cls, torchvitals.TorchvitalsError), cls
    assert issubclass(torchvitals.TrainingAborted, SystemExit)       # still exits with its code
    assert issubclass(MetricsPortError, OSError) and issubclass(PayloadError, ValueError)


NO_TORCH = """raise ImportError("torch is not importable in this test: the command must not need it")\n"""


def _without_torch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``python -m <args>`` where ``import torch`` raises."""
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True, exist_ok=True)
    (shadow / "torch" / "__init__.py").write_text(NO_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(shadow), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)


def _a_real_run(tmp_path: Path) -> Path:
    """A short real run's folder (event log and ledger), written by the agent here, with torch."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    agent = torchvitals.watch(model, opt, log_dir=str(tmp_path / "runs"), run_name="r",
                              checkpoint_dir=str(tmp_path / "runs" / "r" / "ckpt"),
                              checkpoint_every=5, metrics_port=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        x = torch.randn(16, 4, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        agent.step(loss)
        opt.zero_grad()
    agent.close()
    return tmp_path / "runs" / "r"


def test_the_torch_free_commands_run_where_torch_cannot_be_imported(tmp_path):
    assert "must not need it" in _without_torch(tmp_path, "torchvitals.agent.agent").stderr
    run = _a_real_run(tmp_path)
    for args, expect in [(("torchvitals", "supervise", "--help"), "--hang-timeout-s"),
                         (("torchvitals.collector", "--help"), "--state-dir"),
                         (("torchvitals", "diagnose", str(run / "events.jsonl")), "cause:"),
                         (("torchvitals", "report", str(run)), "report.html")]:
        out = _without_torch(tmp_path, *args)
        assert out.returncode == 0 and expect in out.stdout, (args, out.stderr[-2000:])
    assert (run / "loss.png").is_file()


@pytest.mark.parametrize("cls, argv", [(SupervisorConfig, ["torchvitals", "supervise", "--help"]),
                                       (CollectorConfig, ["torchvitals.collector", "--help"])])
def test_every_flag_says_what_it_does_and_its_default(cls, argv):
    out = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in ("webhook_token", "job_tokens"):   # never a flag: it would show in ps
            assert "--" + f.name.replace("_", "-") + " " not in text
            continue
        assert "--" + f.name.replace("_", "-") in text
        first_words = " ".join(docs[f.name].split()[:4])
        assert first_words in text, (f.name, first_words)
        default = "none" if f.default is None else str(f.default)
        assert f"(default: {default};" in text, (f.name, default)
