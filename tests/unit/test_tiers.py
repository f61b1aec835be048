"""The test tiers hold: tests/unit starts no process, no test imports from examples/, and every
test file lives in a tier folder.

    python -m pytest tests/unit/test_tiers.py
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
EXAMPLES = {p.stem for p in (TESTS.parent / "examples").glob("*.py")}
TIERS = {"unit", "distributed", "integration", "scenarios", "deploy", "multinode"}
STARTS_A_PROCESS = {
    "subprocess",
    "multiprocessing",
    "torch.multiprocessing",
    "torch.distributed.run",
    "support.world.run_world",
    "support.world.spawn_job",
}
"""Modules whose import in tests/unit means a test starts a process (ranks, a command, a job)."""


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_unit_tests_start_no_process():
    started = {}
    for path in sorted((TESTS / "unit").glob("test_*.py")):  # conftest.py: the guard itself
        found = _imports(path) & STARTS_A_PROCESS
        if found:
            started[path.name] = sorted(found)
    assert not started, f"move these to tests/integration or tests/distributed: {started}"


def _puts_examples_on_the_path(path: Path) -> bool:
    """A ``sys.path`` insert, append, extend or assignment that names examples/."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            touches = ast.unparse(node.func).startswith("sys.path.")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            touches = any(ast.unparse(t).startswith("sys.path") for t in targets)
        else:
            continue
        if touches and "examples" in ast.unparse(node):
            return True
    return False


def test_no_test_imports_from_examples():
    wrong = {}
    for path in sorted(TESTS.rglob("*.py")):
        from_examples = {name.split(".")[0] for name in _imports(path)} & EXAMPLES
        if from_examples or _puts_examples_on_the_path(path):
            wrong[str(path.relative_to(TESTS))] = sorted(from_examples) or "examples/ on sys.path"
    assert not wrong, f"tests share models through tests/support, not examples/: {wrong}"


def test_every_test_file_lives_in_a_tier():
    misplaced = [
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("test_*.py")
        if p.relative_to(TESTS).parts[0] not in TIERS
    ]
    assert not misplaced, misplaced


def test_every_test_module_has_a_name_of_its_own():
    """pytest imports test files by their base name (the tiers are not packages), and a tier's
    helper modules are imported by name from its folder: two files of one name in two tiers fail
    the whole run's collection ("import file mismatch"), or hand one tier's spawned ranks the
    other's helper."""
    seen: dict[str, list[str]] = {}
    for path in TESTS.glob("*/*.py"):
        if path.name not in ("conftest.py", "__init__.py") and path.parent.name != "support":
            seen.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert not {n: p for n, p in seen.items() if len(p) > 1}
