"""A rank's stacks on the stack signal, without its cooperation: registered at watch() when a
heartbeat folder is set, named in every heartbeat, chained to a user's own handler, and given
back at close(). (A separate process spinning in its main thread: tests/distributed/
test_stacks_process.py.)"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import torch
from support.models import TINY, TinyGPT

import torchvitals
from torchvitals.protocol import STACK_SIGNAL, heartbeat_path, read_rank_beats, stack_path

QUIET = {"log_dir": "", "metrics_port": 0}


def _watch(folder):
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    return torchvitals.watch(
        model, torch.optim.SGD(model.parameters(), lr=0.1), heartbeat_dir=str(folder), **QUIET
    )


def spin_in_user_code(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(100))


def _dump_with_a_thread_spinning(folder) -> str:
    stop = threading.Event()
    spinner = threading.Thread(target=spin_in_user_code, args=(stop,), daemon=True)
    spinner.start()
    try:
        os.kill(os.getpid(), STACK_SIGNAL)
        time.sleep(0.05)
    finally:
        stop.set()
        spinner.join(5)
    return stack_path(folder, 0).read_text()


def test_the_signal_writes_every_threads_stack_and_the_heartbeat_names_it(tmp_path):
    agent = _watch(tmp_path)
    try:
        assert read_rank_beats(tmp_path)[0].stack_signal == STACK_SIGNAL
        text = _dump_with_a_thread_spinning(tmp_path)
        assert "spin_in_user_code" in text, text
        assert "_dump_with_a_thread_spinning" in text, text  # every thread, this one too
    finally:
        agent.close()
    # Unregistered, and the heartbeat says so: nothing would send a signal that ends the rank.
    assert read_rank_beats(tmp_path)[0].stack_signal is None
    assert "stack_signal" not in json.loads(heartbeat_path(tmp_path, 0).read_text())
    assert signal.getsignal(STACK_SIGNAL) == signal.SIG_DFL


def test_a_users_own_handler_of_the_signal_keeps_running(tmp_path):
    seen = []
    previous = signal.signal(STACK_SIGNAL, lambda signum, frame: seen.append(signum))
    try:
        agent = _watch(tmp_path)
        try:
            os.kill(os.getpid(), STACK_SIGNAL)
            deadline = time.monotonic() + 5
            while not seen and time.monotonic() < deadline:
                time.sleep(0.01)
            assert seen == [STACK_SIGNAL]
            assert "test_a_users_own_handler" in stack_path(tmp_path, 0).read_text()
        finally:
            agent.close()
        assert signal.getsignal(STACK_SIGNAL) is not signal.SIG_DFL  # theirs is back
    finally:
        signal.signal(STACK_SIGNAL, previous)


def test_no_heartbeat_folder_registers_nothing(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    agent = torchvitals.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), **QUIET)
    try:
        assert signal.getsignal(STACK_SIGNAL) == signal.SIG_DFL
        assert not list(tmp_path.iterdir())
    finally:
        agent.close()


def test_two_agents_in_one_process_hand_the_signal_back(tmp_path):
    first = _watch(tmp_path / "a")
    second = _watch(tmp_path / "b")
    assert "spin_in_user_code" in _dump_with_a_thread_spinning(tmp_path / "b")
    second.close()
    try:
        text = _dump_with_a_thread_spinning(tmp_path / "a")  # the first agent's file again
        assert "spin_in_user_code" in text
    finally:
        first.close()
    assert signal.getsignal(STACK_SIGNAL) == signal.SIG_DFL
