"""The collector's side of the package imports without torch (its image does not need it), and
the training side's names are there on first use."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_collector_and_the_supervisor_import_without_torch():
    assert run("import sys, torchvitals.collector, torchvitals.collector.__main__; "
               "print('torch' in sys.modules)") == "False"


def test_the_public_names_load_on_first_use():
    import torchvitals
    import torchvitals.agent
    for name in torchvitals.__all__:
        assert getattr(torchvitals, name).__name__ == name
        assert name in dir(torchvitals)
    assert torchvitals.agent.Config is torchvitals.Config
    assert run("import torchvitals; print(torchvitals.watch.__module__)") == "torchvitals.agent.agent"
    try:
        torchvitals.no_such_name
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
