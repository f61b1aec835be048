"""The package's shape holds: stages import only what comes before them, nothing imports in a
cycle, each wire contract is spelled once, every deliberate error shares one base. (That the
torch-free commands run without torch, and every --help explains its flags, needs a fresh
process: tests/integration/test_commands.py.)"""

from __future__ import annotations

import ast
import builtins
import functools
import re
from pathlib import Path

import pytest
import torch

import torchvitals
from torchvitals import protocol

ROOT = Path(torchvitals.__file__).resolve().parent
STAGES = {"measure": 1, "detect": 2, "recover": 3, "outputs": 4, "tools": 5, "integrations": 5}
"""Each stage of agent/ may import only the stages up to its own."""
BELOW_STAGES = ("torchvitals.agent.compat", "torchvitals.agent.backends")
"""Packages below every stage, like ``config`` and ``report``: the private names of torch and
the frameworks, and the optimizer backends (which the measures and ``recover`` read). Every
stage may import them; they import no stage."""
LEAVES = {"torchvitals.agent.detect.verdict", "torchvitals.agent.detect.thresholds"}
"""Plain data every stage may import: the pattern table, the thresholds."""


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for every test here (none changes it)."""
    return ast.parse(path.read_text())


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
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
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


def _below_stages(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in BELOW_STAGES)


def test_the_compat_and_backend_packages_sit_below_every_stage():
    assert all(p in MODULES for p in BELOW_STAGES), BELOW_STAGES  # no stale name
    wrong = {
        module: sorted(staged)
        for module, targets in GRAPH.items()
        if _below_stages(module)
        and (
            staged := {
                t
                for t in targets
                if _stage(t) is not None
                or t
                in (
                    "torchvitals.agent.agent",
                    "torchvitals.agent.build",
                    "torchvitals.agent.guard",
                )
                or t.startswith(("torchvitals.agent.step", "torchvitals.agent.signals"))
            }
        )
    }
    assert not wrong, wrong
    assert "torchvitals.agent.backends.base" in GRAPH["torchvitals.agent.measure.stats"]
    assert "torchvitals.agent.backends.base" in GRAPH["torchvitals.agent.recover.state"]


def test_no_stage_imports_a_later_one():
    wrong = []
    for module, targets in GRAPH.items():
        mine = _stage(module)
        for target in targets - LEAVES:
            theirs = _stage(target)
            if theirs is None:
                if target in (
                    "torchvitals.agent.agent",
                    "torchvitals.agent.build",
                    "torchvitals.agent.guard",
                ) and mine not in (None, STAGES["tools"]):
                    wrong.append((module, target))
                continue
            if (
                mine is None
                and module.startswith("torchvitals.agent.")
                and module
                not in (
                    "torchvitals.agent.agent",
                    "torchvitals.agent.build",  # watch()'s construction, split from agent.py
                    "torchvitals.agent.step",
                    "torchvitals.agent.seams",
                )
                and not module.startswith("torchvitals.agent.signals.")
            ):
                wrong.append((module, target))  # config/report are below every stage
            elif mine is not None and theirs > mine:
                wrong.append((module, target))
    assert not wrong, wrong


STEP_STAGES = {
    "pack": "measure",
    "reduce": "reduce",
    "unpack": "reduce",
    "observe": "detect",
    "real_step": "act",
    "rollback": "act",
    "maybe_save": "act",
    "publish": "publish",
}
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
        for node in ast.walk(_parsed(path)):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in STEP_STAGES
            ):
                continue
            owner = node.func.value
            owner = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            owner = owner.lstrip("_")  # the agent's private ``self._guard`` is the guard too
            if owner in receivers:
                calls.setdefault(f"{owner}.{node.func.attr}", set()).add(name)
    assert {
        "signal.pack",
        "signal.unpack",
        "reducer.reduce",
        "detector.observe",
        "guard.real_step",
        "watchdog.rollback",
        "watchdog.maybe_save",
        "outputs.publish",
    } <= set(calls), calls
    elsewhere = {
        call: sorted(m - {"torchvitals.agent.step"})
        for call, m in calls.items()
        if m - {"torchvitals.agent.step"}
    }
    assert not elsewhere, elsewhere
    source = (ROOT / "agent" / "step.py").read_text()
    run = source[source.index("    def run(self, inp: StepInput)") :]
    run = run[: run.index("\n    def ", 10)]
    order = [
        run.index(f"# {stage}")
        for stage in ("measure", "reduce", "detect", "decide and act", "publish")
    ]
    assert order == sorted(order), "Steps.run reads measure, reduce, detect, decide/act, publish"


def _built_signal_classes() -> dict[str, type]:
    """Registry name -> the Signal class its factory builds (from the factory's return type)."""
    import types
    import typing

    from torchvitals.agent.signals.registry import BUILTIN

    built = {}
    for name, factory in BUILTIN:
        returned = typing.get_type_hints(factory)["return"]
        if isinstance(returned, types.UnionType):
            returned = next(t for t in typing.get_args(returned) if t is not type(None))
        built[name] = returned
    return built


def test_every_signal_names_real_rules_metrics_and_fields():
    """Each registered signal's declared rules, metric families and filled fields exist (the
    slice's map stays true), and every Signal of ``agent/signals/`` is built by the registry:
    the registry is the one list, so adding a signal needs no count kept anywhere."""
    import dataclasses
    import importlib
    import inspect

    from torchvitals.agent.detect import rules, rules_vitals, straggler
    from torchvitals.agent.detect.observed import Observed
    from torchvitals.agent.detect.verdict import COLLECTOR_DIRECTIVE
    from torchvitals.agent.outputs import metrics
    from torchvitals.agent.report import Report
    from torchvitals.agent.signals.base import Signal

    rule_names = {
        n
        for mod in (rules, rules_vitals, straggler)
        for n, _ in inspect.getmembers(mod, inspect.isclass)
    } | {COLLECTOR_DIRECTIVE}
    metric_source = inspect.getsource(metrics)
    report_fields = {f.name for f in dataclasses.fields(Report)} | {
        n for n, v in vars(Report).items() if isinstance(v, property)
    }
    built = _built_signal_classes()
    for name, cls in built.items():
        assert issubclass(cls, Signal) and cls is not Signal, (name, cls)
        assert set(cls.rules) <= rule_names, (cls, set(cls.rules) - rule_names)
        assert all(f'"{m}"' in metric_source for m in cls.metrics), cls
        assert cls.fills, f"{cls.__name__} names no field it fills"
        for path in cls.fills:
            head, _, rest = path.partition(".")
            if head == "seen":
                assert rest in {f.name for f in dataclasses.fields(Observed)}, (cls, path)
            else:
                assert head in report_fields, (cls, path)
                record = next((f for f in dataclasses.fields(Report) if f.name == head), None)
                factory = getattr(record, "default_factory", dataclasses.MISSING)
                made = None if factory is dataclasses.MISSING else factory()
                if rest and dataclasses.is_dataclass(made):  # report.<record>.<field>
                    assert rest in {f.name for f in dataclasses.fields(made)}, (cls, path)
    defined = set()
    for path in sorted((ROOT / "agent" / "signals").glob("*.py")):
        module = importlib.import_module(f"torchvitals.agent.signals.{path.stem}")
        defined |= {
            cls
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, Signal) and cls is not Signal and cls.__module__ == module.__name__
        }
    assert defined == set(built.values()), defined ^ set(built.values())


def test_no_signal_shares_a_name_with_a_rule():
    """``Activations`` the rule and ``ActivationSignal`` the signal: one name, one thing."""
    import inspect

    from torchvitals.agent.detect import rules, rules_vitals, straggler

    rule_names = {n for mod in (rules, rules_vitals, straggler) for n, _ in inspect.getmembers(mod)}
    clash = {cls.__name__ for cls in _built_signal_classes().values()} & rule_names
    assert not clash, clash


def test_the_step_never_takes_or_holds_the_agent():
    """``Steps`` gets a frozen ``StepDeps`` of typed collaborators, never the Agent: no import
    of ``agent.py``, no parameter or attribute called ``agent``/``a``, no ``Agent`` or ``Any``
    annotation on what ``Steps`` is built from."""
    import dataclasses
    import inspect

    from torchvitals.agent.step import StepDeps, Steps

    tree = ast.parse(MODULES["torchvitals.agent.step"].read_text())
    assert "torchvitals.agent.agent" not in GRAPH["torchvitals.agent.step"]
    params = {
        a.arg
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for a in fn.args.args + fn.args.kwonlyargs
    }
    assert not params & {"agent", "a"}, params & {"agent", "a"}
    stored = {
        t.attr
        for n in ast.walk(tree)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and _is_self(t.value)
    }
    assert not stored & {"agent", "a"}, stored
    annotations = [
        ast.unparse(n.annotation)
        for n in ast.walk(tree)
        if isinstance(n, (ast.arg, ast.AnnAssign)) and n.annotation is not None
    ]
    assert not [a for a in annotations if "Agent" in a], annotations
    init = inspect.signature(Steps.__init__).parameters
    assert [init[p].annotation for p in init if p != "self"] == ["StepDeps", "int"], init
    assert dataclasses.is_dataclass(StepDeps) and StepDeps.__dataclass_params__.frozen
    loose = [f.name for f in dataclasses.fields(StepDeps) if f.type in ("Any", "object")]
    assert set(loose) <= {"optimizer", "state_holder", "scheduler"}, loose  # foreign objects


def _agentish(node: ast.AST) -> bool:
    """An expression that names an agent: ``agent``, ``self.agent``, ``hf_agent``, ``agent()``."""
    if isinstance(node, ast.Call):
        node = node.func
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name == "agent" or name.endswith("_agent")


def private_agent_reads(source: str) -> list[str]:
    """Each use of a private attribute of something named an agent (``agent._closing``,
    ``self.agent._patches``, ``agent()._x``); dunders and the agent's own ``self._x`` aside."""
    return [
        f"{n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Attribute)
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
        and _agentish(n.value)
    ]


@pytest.mark.parametrize(
    "source",
    [
        "agent._closing.callback(adapter.close)",
        "self.agent._patches.close()",
        "x = hf_agent._wait",
        "agent()._patches.closed",
        "agent._x = 1",
    ],
)
def test_the_private_agent_rule_sees_each_use(source):
    assert private_agent_reads(source), source


@pytest.mark.parametrize(
    "source",
    ["agent.on_close(adapter.close)", "self._agent.step(loss)", "agent.__class__", "self._x = 1"],
)
def test_the_private_agent_rule_leaves_public_hooks_alone(source):
    assert not private_agent_reads(source), source


AGENT_OWNERS = ("torchvitals.agent.agent", "torchvitals.agent.build")
"""The agent's own modules: ``agent.py`` and ``build.py``, which fills its attributes at
``watch()``. Only they use its private attributes."""


def test_no_private_attribute_of_the_agent_is_used_outside_agent_py():
    """Integrations, tools, benchmarks and examples reach the agent through its public hooks
    (``on_close``, ``attach``, ``resume_at``, ``ticks``), never its private attributes; only
    ``AGENT_OWNERS`` use them."""
    assert set(AGENT_OWNERS) <= set(MODULES), AGENT_OWNERS  # no stale name
    sources = {m: p for m, p in MODULES.items() if m not in AGENT_OWNERS}
    for folder in ("benchmarks", "examples"):
        sources |= {f"{folder}/{p.name}": p for p in sorted((ROOT / folder).glob("*.py"))}
    assert any(m.startswith("examples/") for m in sources), "examples/ was read"
    wrong = {m: found for m, p in sources.items() if (found := private_agent_reads(p.read_text()))}
    assert not wrong, wrong


def test_no_import_cycle_anywhere():
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            # A package's lazy __getattr__ names its modules as strings, not imports: no edge.
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_nothing_outside_the_agent_imports_from_it():
    """The agent imports the shared layers (records, protocol, settings, errors); nothing below
    or beside it imports the agent: the supervisor, the collector and the commands that read a
    job's folder load neither torch nor the agent. The package's ``__init__`` (its lazy public
    names) and ``__main__`` (the CLI, which imports a command's module when it runs) aside."""
    wrong = {}
    for module, targets in GRAPH.items():
        if module.startswith("torchvitals.agent") or module in (
            "torchvitals",
            "torchvitals.__main__",
        ):
            continue
        if into_agent := sorted(t for t in targets if t.startswith("torchvitals.agent")):
            wrong[module] = into_agent
    assert not wrong, wrong


def test_the_records_import_only_the_shared_layers():
    allowed = {"torchvitals.errors", "torchvitals.protocol"}
    for module, targets in GRAPH.items():
        if module.startswith("torchvitals.records"):
            outside = {t for t in targets if not t.startswith("torchvitals.records")}
            assert outside <= allowed, (module, outside - allowed)


def test_the_supervisor_never_imports_the_collector():
    """The supervisor runs on every node, the webhook service beside the job: neither imports
    the other (each module's imports, in functions too)."""
    wrong = {
        module: sorted(into)
        for module, targets in GRAPH.items()
        if _within(module, "torchvitals.supervisor")
        and (into := {t for t in targets if _within(t, "torchvitals.collector")})
    }
    assert not wrong, wrong


def test_the_collector_imports_neither_the_agent_nor_the_supervisor():
    assert "torchvitals.collector.webhook" in GRAPH  # no stale name
    wrong = {
        module: sorted(into)
        for module, targets in GRAPH.items()
        if _within(module, "torchvitals.collector")
        and (
            into := {
                t
                for t in targets
                if _within(t, "torchvitals.agent") or _within(t, "torchvitals.supervisor")
            }
        )
    }
    assert not wrong, wrong


@pytest.mark.parametrize(
    "literal",
    [
        "torchvitals_action",
        "ledger.json",
        "aborted",
        "TORCHVITALS_HEARTBEAT_DIR",
        "TORCHVITALS_WEBHOOK_TOKEN",
        "TORCHVITALS_WEBHOOK_TOKEN_FILE",
        "TORCHVITALS_SUPERVISOR_ATTEMPT",
    ],
)
def test_each_wire_contract_is_spelled_once(literal):
    """The literal lives in protocol.py; every other module imports the name."""
    spelled = []
    for module, path in MODULES.items():
        tree = _parsed(path)
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and node.value == literal
                and id(node) not in docstrings
            ):
                spelled.append(module)
    assert set(spelled) <= {"torchvitals.protocol"}, spelled
    assert literal in {v for v in vars(protocol).values() if isinstance(v, str)}


def _class_bases() -> dict[str, set[str]]:
    """Every class the package defines at a module's top level: its name, its bases' names."""
    found: dict[str, set[str]] = {}
    for path in MODULES.values():
        for node in _parsed(path).body:
            if isinstance(node, ast.ClassDef):
                names = {
                    b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                    for b in node.bases
                }
                found.setdefault(node.name, set()).update(names)
    return found


def _descendants(bases: dict[str, set[str]], roots: set[str]) -> set[str]:
    """The classes that derive, through the package's own classes, from any of ``roots``."""
    found = set(roots)
    while grown := {name for name, of in bases.items() if of & found} - found:
        found |= grown
    return found


def test_every_error_raised_on_purpose_shares_one_base():
    """Every public exception class the package defines (warnings aside) is a TorchvitalsError,
    read from the source of every module, so a new one cannot be missed."""
    from torchvitals.agent.outputs.exporter import MetricsPortError
    from torchvitals.collector.webhook import PayloadError

    bases = _class_bases()
    builtin = {
        name
        for name, cls in vars(builtins).items()
        if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, Warning)
    }
    foreign = {b for of in bases.values() for b in of if b.endswith(("Error", "Exception"))}
    errors = _descendants(bases, builtin | foreign) - builtin - foreign
    ours = _descendants(bases, {"TorchvitalsError"})
    outside = sorted(n for n in errors - ours if not n.startswith("_"))
    assert "CheckpointError" in errors and "TrainingAborted" in errors  # the scan sees them
    assert not outside, f"public errors that are not TorchvitalsErrors: {outside}"
    assert issubclass(torchvitals.TrainingAborted, SystemExit)  # still exits with its code
    assert issubclass(MetricsPortError, OSError) and issubclass(PayloadError, ValueError)


# ---------------------------------------------------------------- patches and private names

FOREIGN = ("torch", "accelerate", "transformers", "lightning")
"""Packages whose attributes only the ``agent/patches/`` package (and, for private flags,
``compat``) set."""
PATCHES = "torchvitals.agent.patches"
"""The package that replaces callables (under its lock, undone): every module in it."""
COMPAT = "torchvitals.agent.compat"
"""The package that reads (and checks) every private torch and framework name: every module."""
MAY_SET_FOREIGN = {PATCHES, f"{COMPAT}.pytorch", f"{COMPAT}.accelerate"}
"""``patches`` replaces callables; ``compat.pytorch`` and ``compat.accelerate`` write the private
flags torch and accelerate read (``optimizer._opt_called``, accelerate's ``_is_overflow``)."""


def _may_set_foreign(module: str) -> bool:
    return module in MAY_SET_FOREIGN or module.startswith(PATCHES + ".")


def _foreign_callables() -> set[str]:
    """The methods of the torch objects the agent is handed: assigning one (``optimizer.step
    = ...``, ``model.forward = ...``) is a patch, whatever the variable is called."""
    classes = (
        torch.optim.Optimizer,
        torch.amp.GradScaler,
        torch.optim.lr_scheduler.LRScheduler,
        torch.nn.Module,
    )
    return {
        n
        for cls in classes
        for n in dir(cls)
        if not n.startswith("__") and callable(getattr(cls, n, None))
    }


FOREIGN_CALLABLES = _foreign_callables()


def _foreign_names(tree: ast.AST) -> set[str]:
    """The names a module binds, by import, to a torch (or framework) module or object."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] in FOREIGN
            }
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and node.module
            and node.module.split(".")[0] in FOREIGN
        ):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def foreign_assignments(source: str, agent_owner: bool = False) -> list[str]:
    """Each assignment (``=``, ``+=``, ``del``, ``setattr``/``delattr``) in ``source`` to an
    attribute of a torch/framework name bound by import (``GradScaler.step``,
    ``clip_grad._clip_grads_with_norm_``, ``torch.nn.utils.x``), to a torch object's method
    (``optimizer.step``, ``self.model.forward``), or to a private attribute of anything but the
    module's own ``self``/``cls`` (``opt._opt_called``). ``agent_owner``: ``source`` is one of
    ``AGENT_OWNERS``, which may also fill the private attributes of the agent it builds
    (``agent._patches``, a plain name ``agent`` only)."""
    tree = ast.parse(source)
    foreign = _foreign_names(tree)
    targets: list[tuple[ast.AST, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            found = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            found = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and len(node.args) >= 2
        ):
            name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
            targets.append((node.args[0], name, node.lineno))
            continue
        else:
            continue
        for target in found:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.ctx, (ast.Store, ast.Del)):
                    targets.append((t.value, t.attr, node.lineno))
    wrong = []
    for base, name, line in targets:
        root = _root(base)
        if agent_owner and isinstance(base, ast.Name) and base.id == "agent":
            continue
        if (isinstance(root, ast.Name) and root.id in foreign) or (
            not _is_self(base)
            and (name is not None and (name in FOREIGN_CALLABLES or name.startswith("_")))
        ):
            wrong.append(f"{line}: {ast.unparse(base)}.{name or '<name>'}")
    return wrong


@pytest.mark.parametrize(
    "source",
    [
        "from torch.amp.grad_scaler import GradScaler\nGradScaler.step = f",
        "from torch.nn.utils import clip_grad\nclip_grad._clip_grads_with_norm_ = f",
        "import torch\ntorch.nn.utils.clip_grads_with_norm_ = f",
        "import torch.nn.utils as u\nsetattr(u, name, f)",
        "import torch\ndel torch.nn.utils.clip_grads_with_norm_",
        "optimizer.step = f",
        "self.optimizer.step = f",
        "setattr(opt, 'zero_grad', f)",
        "model.forward = f",
        "opt._opt_called = True",
        "fn._wrapped_by_lr_sched = True",
    ],
)
def test_the_patch_rule_sees_each_way_of_patching(source):
    assert foreign_assignments(source), source


@pytest.mark.parametrize(
    "source",
    [
        "m.training = was",
        "report.lr = [0.1]",
        "self.step = f",
        "self._inside = True",
        "args.job_command = c",
        "self.agent.loss_book.capture = False",
    ],
)
def test_the_patch_rule_leaves_plain_state_alone(source):
    assert not foreign_assignments(source), source


def test_the_agents_builder_may_fill_only_the_agents_private_attributes():
    assert not foreign_assignments("agent._patches = PatchSet()", agent_owner=True)
    assert foreign_assignments("agent._patches = PatchSet()")
    for source in ("opt._opt_called = True", "agent.model.forward = f", "self.agent._x = 1"):
        assert foreign_assignments(source, agent_owner=True), source


def test_only_the_patches_package_assigns_to_torch_attributes():
    assert set(MODULES) >= MAY_SET_FOREIGN, MAY_SET_FOREIGN - set(MODULES)  # no stale exemption
    assert _may_set_foreign(f"{PATCHES}.shared")
    assert not _may_set_foreign(f"{PATCHES}_extra")
    wrong = {
        module: found
        for module, path in MODULES.items()
        if not _may_set_foreign(module)
        and (found := foreign_assignments(path.read_text(), agent_owner=module in AGENT_OWNERS))
    }
    assert not wrong, wrong


def _in_compat(module: str) -> bool:
    return module == COMPAT or module.startswith(COMPAT + ".")


def _private_names_compat_reads() -> set[str]:
    """The private names any module of the compat package reads or spells."""
    return {
        name
        for module, path in MODULES.items()
        if _in_compat(module)
        for name in _private_names_read(_parsed(path))
    }


def _private_names_read(tree: ast.AST) -> set[str]:
    names = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
        and not _is_self(n.value)
    }
    names |= {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and n.value.isidentifier()
        and n.value.startswith("_")
        and not n.value.startswith("__")
    }
    return names


def private_reads(source: str, private: set[str]) -> list[str]:
    """Each read of a private torch/framework name in ``source``: an attribute starting with
    ``_`` of a name bound to torch by import (``torch._foreach_norm``), an import of one
    (``from torch.distributed._state_dict_utils import ...``), or one of ``private`` (the names
    ``compat`` reads on torch objects, e.g. ``_per_optimizer_states``) on anything."""
    tree = ast.parse(source)
    foreign = _foreign_names(tree)
    wrong = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not _is_self(node.value)
        ):
            root = _root(node.value)
            if node.attr in private or (isinstance(root, ast.Name) and root.id in foreign):
                wrong.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in private
        ):
            wrong.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            names = [a.name for a in node.names]
            paths = [module + "." + n for n in names] if module else names
            if any(
                p.split(".")[0] in FOREIGN and any(part.startswith("_") for part in p.split("."))
                for p in paths
            ) and not getattr(node, "level", 0):
                wrong.append(f"{node.lineno}: import {', '.join(paths)}")
    return wrong


def test_private_torch_names_are_read_only_through_compat():
    private = _private_names_compat_reads()
    assert {
        "_per_optimizer_states",
        "_get_scale_async",
        "_opt_called",
        "_is_overflow",
        "_clip_grads_with_norm_",
        "_orig_mod",
    } <= private, private
    assert private_reads("import torch\ntorch._foreach_norm(x)", private)
    assert private_reads("from torch.distributed._state_dict_utils import f", private)
    assert private_reads("s = scaler._per_optimizer_states", private)
    assert not private_reads("self._per_optimizer_states = {}\nx = torch.nn.utils", private)
    wrong = {
        module: found
        for module, path in MODULES.items()
        if not _in_compat(module) and (found := private_reads(path.read_text(), private))
    }
    assert not wrong, wrong


# ---------------------------------------------------------------- framework names

FRAMEWORK_WORDS = re.compile(
    r"deepspeed|zero3|is_zero|zero_optimi[sz]ation|accelerate|torchtitan|lightning|transformers",
    re.IGNORECASE,
)
"""What names a framework or one of DeepSpeed's ZeRO kinds (``accelerate``, not torch's
``accelerator``; ``is_zero``, not ``zero_grad``)."""
MAY_NAME_FRAMEWORKS = (
    COMPAT,
    "torchvitals.agent.backends",
    "torchvitals.agent.integrations",
    "torchvitals.agent.tools.examples",
)
"""Packages that know frameworks: their private names (``compat``), one optimizer backend per
kind (``backends``), their callbacks and adapters (``integrations``), the framework examples
users run (``tools.examples``)."""
MAY_NAME_FRAMEWORKS_MODULES = {
    "torchvitals": "lazily exports the integrations' entry points (LightningCallback, ...)",
    f"{PATCHES}.shared": "patches DeepSpeed's engine's clip_grad_norm_ (ZeRO off)",
    "torchvitals.agent.tools.demo.regression": "the DeepSpeed config the examples train with",
}
"""The only other modules that may, each with why."""


def framework_names(source: str) -> list[str]:
    """Each place ``source`` names a framework in code: an import, a name or attribute (a kind
    test such as ``is_zero_optimizer``), a definition, a string literal (a module-name test
    such as ``__module__ == "deepspeed..."``, an error message). Docstrings and other bare
    string statements are documentation, and comments are not in the tree: neither counts."""
    tree = ast.parse(source)
    documentation = {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            words = [w for a in node.names for w in (a.name, a.asname)]
        elif isinstance(node, ast.ImportFrom):
            words = [node.module] + [w for a in node.names for w in (a.name, a.asname)]
        elif isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words = [node.name]
        elif isinstance(node, (ast.arg, ast.keyword)):
            words = [node.arg]
        elif isinstance(node, ast.Constant) and id(node) not in documentation:
            words = [node.value] if isinstance(node.value, str) else []
        else:
            continue
        for word in words:
            if isinstance(word, str) and (match := FRAMEWORK_WORDS.search(word)):
                found.append(f"{node.lineno}: {match.group(0)} in {word[:60]!r}")
    return found


@pytest.mark.parametrize(
    "source",
    [
        "import deepspeed",
        "from accelerate.optimizer import AcceleratedOptimizer",
        "from ..compat.deepspeed import full_numel",
        "if is_zero3_optimizer(o): pass",
        "ok = type(o).__module__.startswith('deepspeed.')",
        "def watch_torchtitan(trainer): pass",
        "raise TypeError(f'use {x} with lightning')",
        "config = {'zero_optimization': {'stage': 2}}",
    ],
)
def test_the_framework_name_rule_sees_each_way_of_naming_one(source):
    assert framework_names(source), source


@pytest.mark.parametrize(
    "source",
    [
        '"""DeepSpeed\'s ZeRO-3 keeps its partitions (a docstring)."""',
        "x = 1  # accelerate's wrapper (a comment)",
        "optimizer.zero_grad(set_to_none=True)",
        "device = torch.accelerator.current_accelerator()",
        'NAME = "n"\n"""What torchtitan calls it (an attribute docstring)."""',
    ],
)
def test_the_framework_name_rule_leaves_documentation_and_torch_alone(source):
    assert not framework_names(source), source


def test_framework_names_appear_only_in_their_backend_compat_and_integration_modules():
    """Framework names (DeepSpeed and its ZeRO kinds, accelerate, torchtitan, Lightning,
    transformers) appear in code only in ``agent/compat/`` (their private names, checked),
    ``agent/backends/`` (one optimizer backend per kind, chosen once at ``watch()``),
    ``agent/integrations/`` (their callbacks and adapters), ``agent/tools/examples/`` (the
    framework examples, shipped), and the few modules of
    ``MAY_NAME_FRAMEWORKS_MODULES``, each with its reason: everywhere else asks the backend, so
    a new kind is one backend module and no ``if is_kind(x)`` elsewhere."""
    assert set(MAY_NAME_FRAMEWORKS) | set(MAY_NAME_FRAMEWORKS_MODULES) <= set(MODULES)

    def allowed(module: str) -> bool:
        return module in MAY_NAME_FRAMEWORKS_MODULES or any(
            module == p or module.startswith(p + ".") for p in MAY_NAME_FRAMEWORKS
        )

    named = {module: framework_names(path.read_text()) for module, path in MODULES.items()}
    wrong = {module: found for module, found in named.items() if found and not allowed(module)}
    assert not wrong, wrong
    stale = sorted(m for m in MAY_NAME_FRAMEWORKS_MODULES if not named[m])
    assert not stale, f"exempt but naming no framework: {stale}"


def test_every_package_folder_is_in_the_distribution():
    """A non-editable install (the Docker image's ``pip install .``) ships only the packages
    pyproject.toml lists: a new folder left off would import in the checkout and fail there."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(("torchvitals", *p.parent.relative_to(ROOT).parts))
        for p in ROOT.rglob("__init__.py")
        if p.relative_to(ROOT).parts[0] not in ("tests", "build", ".git")
    }
    assert found == listed, (sorted(found - listed), sorted(listed - found))


# ---------------------------------------------------------------- actions

ACTION_VALUES = {"step", "skip", "rollback", "abort"}
"""The values of ``report.Action``: the package compares and assigns the members, never these."""


def _names_an_action(node: ast.AST) -> bool:
    """``action``, ``x.action``, ``x["action"]`` or ``x.get("action")``."""
    if isinstance(node, ast.Name):
        return node.id == "action"
    if isinstance(node, ast.Attribute):
        return node.attr == "action"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "action"
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "action"
    )


def _action_literals(node: ast.AST | None) -> list[str]:
    """The action values spelled in ``node``: a string, or the strings of a tuple/list/set."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [
        i.value
        for i in items
        if isinstance(i, ast.Constant) and isinstance(i.value, str) and i.value in ACTION_VALUES
    ]


def literal_actions(source: str) -> list[str]:
    """Each action value written as a string literal in ``source`` where an action is compared
    (``==``, ``!=``, ``in``, ``match``), assigned (``=``, an annotated default, ``action=`` in a
    call, ``{"action": ...}``), defaulted (``def f(action="step")``) or given a second name
    (``SKIP = "skip"``). Docstrings and other strings ("event": "rollback", a ledger's entry
    kind) are not actions."""
    tree = ast.parse(source)
    home = {  # the members' own definitions: ``class Action(str, enum.Enum): STEP = "step"``
        id(n)
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef) and c.name == "Action"
        for n in c.body
    }
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in home:
            continue
        pairs: list[tuple[ast.AST | None, ast.AST | None]] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            pairs = [(a, b) for a in operands for b in operands if a is not b]
        elif isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
            pairs += [
                (t, v)
                for t in node.targets
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple)
                for t, v in zip(t.elts, node.value.elts)
            ]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            pairs = [(node.target, node.value)]
        elif isinstance(node, ast.keyword) and node.arg == "action":
            pairs = [(ast.Name("action"), node.value)]
        elif isinstance(node, ast.Dict):
            pairs = [(ast.Subscript(ast.Name("d"), k), v) for k, v in zip(node.keys, node.values)]
        elif isinstance(node, ast.arguments):
            params = [*node.posonlyargs, *node.args]
            defaults = list(zip(params[len(params) - len(node.defaults) :], node.defaults))
            defaults += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d]
            pairs = [(ast.Name(a.arg), d) for a, d in defaults]
        elif isinstance(node, ast.Match):
            pairs = [
                (node.subject, p.value)
                for case in node.cases
                for p in ast.walk(case.pattern)
                if isinstance(p, ast.MatchValue)
            ]
        found += [
            (getattr(node, "lineno", 0), literal)
            for target, value in pairs
            for literal in _action_literals(value)
            if _names_an_action(target)
            or (isinstance(target, ast.Name) and target.id == literal.upper())  # a 2nd spelling
        ]
    return [f"{line}: {value!r}" for line, value in sorted(set(found))]


@pytest.mark.parametrize(
    "source",
    [
        'report.action == "skip"',
        'if "rollback" != r.action: pass',
        'report.action in ("rollback", "skip")',
        'e.get("action") == "rollback"',
        'e["action"] == "abort"',
        'action = "step"',
        'report.action, report.rollback = "rollback", rolled',
        'class R:\n    action: str = "step"',
        'Report(step=1, action="skip")',
        'line = {"action": "rollback"}',
        'def decide(action="step"): pass',
        'def decide(*, action="abort"): pass',
        'match report.action:\n    case "rollback":\n        pass',
        'STEP, SKIP = "step", "skip"',
    ],
)
def test_the_action_rule_sees_each_literal_action(source):
    assert literal_actions(source), source


@pytest.mark.parametrize(
    "source",
    [
        "report.action == Action.SKIP",
        "report.action in (Action.ROLLBACK, Action.SKIP)",
        'e["event"] == "rollback"',
        'entry.get("event", "step") == "step"',
        'def f():\n    """action "rollback" or "skip"."""',
        'AttributePatch(owner, "step", wrap)',
        'state = {"step": 3}',
        'ACTIONS = {"rollback": 1.0, "abort": 2.0}',
    ],
)
def test_the_action_rule_leaves_other_strings_alone(source):
    assert not literal_actions(source), source


def test_no_action_is_a_string_literal_in_the_package():
    """Every action the package compares, assigns or defaults is an ``Action`` member: one
    spelling, which a type checker follows (users' ``report.action == "rollback"`` still holds,
    ``Action`` is a ``str``)."""
    from torchvitals.records.vocabulary import Action

    assert {a.value for a in Action} == ACTION_VALUES
    wrong = {
        module: found
        for module, path in MODULES.items()
        if (found := literal_actions(path.read_text()))
    }
    assert not wrong, wrong


def test_nothing_points_at_an_issue_number():
    """The repository stands alone: no file cites an issue tracker's numbers, which mean
    nothing to a reader of the tree."""
    cited = []
    skip = {".git", "site", "build", "torchvitals.egg-info", "__pycache__", ".venv"}
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if skip & set(rel.parts) or not path.is_file():
            continue
        if path.suffix not in {
            ".py",
            ".md",
            ".toml",
            ".yaml",
            ".yml",
            ".json",
            ".txt",
            ".tpl",
        } and (
            path.name not in {"run", "mypy", "Dockerfile"}
            and not path.name.startswith("Dockerfile")
        ):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(r"\b[Ii]ssues? #?\d+", line):
                cited.append(f"{rel}:{number}")
    assert not cited, f"issue numbers cited: {cited}"
