"""The package's shape holds: stages import only what comes before them, nothing imports in a
cycle, each wire contract is spelled once, every deliberate error shares one base. (That the
torch-free commands run without torch, and every --help explains its flags, needs a fresh
process: tests/integration/test_commands.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torchvitals
from torchvitals import protocol

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
                    "torchvitals.agent.agent", "torchvitals.agent.pipeline"):
                wrong.append((module, target))         # config/report are below every stage
            elif mine is not None and theirs > mine:
                wrong.append((module, target))
    assert not wrong, wrong


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
                                  "torchvitals.agent.recover.durable"}, (module, into_agent)


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
