"""The unit tier stays offline and in-process: a test here that opens a network socket (a
server, a client, a bind) or starts a process fails at once, naming what it did and where such
a test belongs. ``unshare -n python -m pytest tests/unit`` passes for the same reason."""

from __future__ import annotations

import socket
import subprocess

import pytest

NETWORK = (socket.AF_INET, socket.AF_INET6)


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(
            f"a unit test {what}: the unit tier opens no socket and starts no process; "
            f"move this test to tests/integration (or tests/distributed for ranks)"
        )

    return refused


@pytest.fixture(autouse=True)
def _offline_and_in_process(monkeypatch):
    real = socket.socket.__init__

    def network_socket(self, family=-1, *args, **kwargs):
        if family in NETWORK or family == -1:
            _refuse(f"opened a network socket (family {family})")()
        real(self, family, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "__init__", network_socket)
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("started a process"))
