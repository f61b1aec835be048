"""What each side of the package imports: the collector's and ``import torchvitals`` no torch,
the training path no web stack and no plots, and the public names (errors, ``__version__``) are
there on first use.

    python -m pytest tests/integration/test_imports.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "starlette", "uvicorn", "matplotlib", "rich")
"""What a side of the package must not import before it needs it."""
LOADED = f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
"""Code printing which of ``HEAVY`` the process imported."""
BLOCK = """
import importlib.abc, sys
class _Missing(importlib.abc.MetaPathFinder):
    # As if these were not installed (pip uninstall is not ours to run in a shared venv).
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Missing())
"""
PUBLIC_ERRORS = (
    "ResumeRefused",
    "CheckpointError",
    "DoubleStepError",
    "GuardBypassedError",
    "MetricsPortError",
    "ConfigError",
    "LedgerError",
)
"""The errors the README tells users to catch."""


def run(code: str, env: dict | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    if ok:
        assert out.returncode == 0, out.stderr
    return out


def last_line(out: subprocess.CompletedProcess) -> str:
    return out.stdout.strip().splitlines()[-1]


def test_the_collector_and_the_supervisor_import_neither_torch_nor_web_stack_nor_plots():
    # The web stack loads when a collector server is built, never on import.
    assert (
        last_line(
            run(
                "import sys, torchvitals.collector, torchvitals.collector.__main__, "
                "torchvitals.supervisor.command, torchvitals.__main__; " + LOADED
            )
        )
        == "[]"
    )


def test_the_supervisor_options_import_nothing_of_the_collector_nor_the_agent():
    # What `torchvitals supervise` parses its flags with: the supervisor never imports the
    # webhook service, and its options need none of the agent (nor torch, nor the web stack).
    out = run(
        "import sys, torchvitals.supervisor.options; "
        "print(sorted(m for m in sys.modules if m.startswith("
        "('torchvitals.collector', 'torchvitals.agent')))); " + LOADED
    )
    assert out.stdout.split("\n")[-3:-1] == ["[]", "[]"], out.stdout
    # The whole supervisor: the ledger's modules of the agent, never the collector.
    out = run(
        "import sys, torchvitals.supervisor.command; "
        "print(sorted(m for m in sys.modules if m.startswith('torchvitals.collector')))"
    )
    assert last_line(out) == "[]", out.stdout


def test_import_torchvitals_is_torch_free_and_knows_its_version():
    out = run(
        "import sys, torchvitals; print(torchvitals.__version__); "
        "print(torchvitals.ConfigError.__name__); " + LOADED
    )
    version, config_error, loaded = out.stdout.split()
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (config_error, loaded) == ("ConfigError", "[]")


def test_the_public_errors_are_exported_at_the_top_level():
    import torchvitals

    for name in PUBLIC_ERRORS:
        error = getattr(torchvitals, name)
        assert name in torchvitals.__all__
        assert issubclass(error, torchvitals.TorchvitalsError) and error.__name__ == name
        # The very class the code raises, not a copy: `except torchvitals.X` catches it.
        assert getattr(sys.modules[error.__module__], name) is error


def test_the_training_path_imports_no_web_stack_and_no_plots():
    out = run("""
import sys, torch, torchvitals
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
agent = torchvitals.watch(model, opt, log_dir="", metrics_port=0)
for _ in range(3):
    loss = model(torch.randn(16, 4)).pow(2).mean()
    loss.backward()
    report = agent.step(loss)
agent.close()
print(report.step)
heavy = {"starlette", "uvicorn", "matplotlib", "rich"}
print(sorted({m.split('.')[0] for m in sys.modules} & heavy))
""")
    assert out.stdout.split("\n")[-3:-1] == ["3", "[]"], out.stdout


def test_an_unsupported_torch_is_refused_at_watch_naming_it_and_the_range():
    out = run("""
import torch
torch.__version__ = "2.12.1+cu126"        # as an older install would say
import torchvitals
model = torch.nn.Linear(2, 1)
try:
    torchvitals.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), log_dir="",
                      metrics_port=0)
except torchvitals.TorchvitalsError as exc:
    print(type(exc).__name__, exc)
else:
    print("watched")
""")
    assert last_line(out).startswith(
        "CompatError torch 2.12.1+cu126 is older than torchvitals "
        "supports: it needs torch>=2.13.0a0"
    ), out.stdout


def test_the_collector_without_its_extra_exits_2_naming_the_install(tmp_path):
    state = tmp_path / "state"
    env = {**__import__("os").environ, "TORCHVITALS_WEBHOOK_TOKEN": "t" * 16}
    blocked = BLOCK.format(names=("starlette", "uvicorn"))
    out = run(
        blocked + "from torchvitals.collector.__main__ import main\n"
        f"sys.exit(main(['--port', '0', '--state-dir', {str(state)!r}]))",
        env=env,
        ok=False,
    )
    assert out.returncode == 2, out.stderr
    assert "pip install 'torchvitals[collector]'" in out.stderr
    assert "starlette" in out.stderr and "Traceback" not in out.stderr
    assert not state.exists(), "nothing is built before the web stack is known to be there"
    # The supervisor needs no collector extra.
    out = run(
        blocked + "import torchvitals.__main__ as m\nm.main(['supervise', '--help'])", ok=False
    )
    assert out.returncode == 0 and "usage: torchvitals supervise" in out.stdout, out.stderr


def test_torchvitals_help_names_the_command_users_type():
    script = Path(sys.executable).parent / "torchvitals"
    assert script.exists(), f"the console script is not installed next to {sys.executable}"
    for command in ([str(script), "--help"], [sys.executable, "-m", "torchvitals", "--help"]):
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith("usage: torchvitals "), out
    wrong = subprocess.run(
        [str(script), "demo", "--ranks", "two"], capture_output=True, text=True, timeout=60
    )
    assert wrong.returncode == 2 and "torchvitals demo: error: argument --ranks" in wrong.stderr


def test_the_public_names_load_on_first_use():
    import torchvitals
    import torchvitals.agent
    from torchvitals.agent.detect import verdict

    for name in torchvitals.__all__:
        value = getattr(torchvitals, name)
        if isinstance(value, str):  # the severities a user's rule gives: the Verdict's strings
            assert value == getattr(verdict, name), name
        else:
            assert value.__name__ == name
        assert name in dir(torchvitals)
    assert torchvitals.agent.Config is torchvitals.Config
    assert (
        last_line(run("import torchvitals; print(torchvitals.watch.__module__)"))
        == "torchvitals.agent.agent"
    )
    try:
        _ = torchvitals.no_such_name
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
