"""Starting a job's launcher tied to its supervisor, and stopping its processes from outside:
its process group, its descendants, its ranks.

    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent())
    status = stop_group(proc, grace_s=10.0, pids=beat.pids)

The launcher gets a parent-death signal (SIGTERM, on which torchrun stops its workers), so a
supervisor SIGKILLed or OOM-killed never leaves an unsupervised job behind.

torchrun starts each worker in a session of its own, so signalling the launcher's group alone
would orphan the ranks; they are found through /proc and through the pids in their heartbeat
files. A SIGSTOPped rank gets SIGCONT with the SIGTERM, so it can act on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when the thread that forked it ends."""


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child get ``sig`` when the supervisor dies.

    SIGTERM, not SIGKILL: torchrun stops its workers on SIGTERM (they live in sessions of their
    own, so a SIGKILLed torchrun would orphan them). The signal follows the forking *thread*:
    the supervisor starts launchers from its main thread, which lives as long as it does.

    Returns:
        The function, or None where prctl is not available (not Linux).
    """
    if os.uname().sysname != "Linux":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    prctl = libc.prctl  # resolved here: the child between fork and exec does the least
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


def stop_group(
    proc: subprocess.Popen, grace_s: float, pids: Sequence[int] = (), poll_s: float = 0.05
) -> int:
    """Stop the job: the process group led by ``proc``, every descendant of ``proc`` and
    ``pids`` (the ranks' heartbeat pids: torchrun starts each worker in a session of its own,
    outside the launcher's group). SIGTERM (and SIGCONT, so a stopped rank can act on it), then
    SIGKILL to whatever is left after ``grace_s``.

    Returns:
        The leader's exit status.
    """
    pgid = proc.pid
    targets = (_descendants(proc.pid) | set(pids)) - {os.getpid()}
    for sig in (signal.SIGTERM, signal.SIGCONT):
        _killpg(pgid, sig)
        for pid in targets:
            _kill(pid, sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (_group_alive(pgid) or any(map(running, targets))):
        proc.poll()  # reap the leader, or it stays in the group as a zombie
        time.sleep(poll_s)
    _killpg(pgid, signal.SIGKILL)
    for pid in targets:
        if running(pid):
            _kill(pid, signal.SIGKILL)
    return proc.wait()


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone, or not ours
        os.killpg(pgid, sig)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _proc_stats() -> dict[int, list[str]]:
    """pid -> the /proc/<pid>/stat fields after the command name (state, ppid, pgrp, ...)."""
    stats = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats[int(path.parent.name)] = path.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError, ValueError):
            continue
    return stats


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, fields in _proc_stats().items():
        children.setdefault(int(fields[1]), []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` is alive and not a zombie (a zombie holds no port or file)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: orphaned ranks are
    reaped by init, which can take seconds."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not Path("/proc").is_dir():
        return True
    return any(int(f[2]) == pgid and f[0] != "Z" for f in _proc_stats().values())
