"""A rank spinning in its own Python code answers the stack signal without its cooperation: a
real process calls watch() with a heartbeat folder, then spins in a named function in its main
thread; the signal its heartbeat names writes that frame into its stack file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from torchvitals.protocol import STACK_SIGNAL, read_rank_beats, stack_path

CHILD = textwrap.dedent(
    """
    import sys
    import torch
    import torchvitals
    from torchvitals.agent.tools.demo.model import TinyGPT

    def spin_in_user_code():
        while True:
            sum(range(1000))

    model = TinyGPT(vocab=32, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    agent = torchvitals.watch(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        heartbeat_dir=sys.argv[1], log_dir="", metrics_port=0,
    )
    spin_in_user_code()
    """
)


def _wait(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s")


def test_a_rank_spinning_in_user_code_shows_that_frame(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], stderr=subprocess.PIPE, text=True
    )
    try:
        beat = _wait(lambda: read_rank_beats(tmp_path).get(0))
        assert beat.pid == child.pid and beat.stack_signal == STACK_SIGNAL
        text = _wait(lambda: _ask(child.pid, beat.stack_signal, tmp_path), timeout=20)
        assert 'File "<string>"' in text, text
        assert child.poll() is None, "the signal ended the rank"
    finally:
        child.kill()
        child.wait(30)


def _ask(pid: int, signum: int, folder) -> str | None:
    """Send the signal; the stack file once it shows the spinning frame (the first signal may
    come while watch() is still returning)."""
    os.kill(pid, signum)
    time.sleep(0.2)
    text = stack_path(folder, 0).read_text()
    return text if "spin_in_user_code" in text else None
