"""Stopping a job's processes from outside: its process group, its descendants, its ranks.

    status = stop_group(proc, grace_s=10.0, pids=beat.pids)

torchrun starts each worker in a session of its own, so signalling the launcher's group alone
would orphan the ranks; they are found through /proc and through the pids in their heartbeat
files. A SIGSTOPped rank gets SIGCONT with the SIGTERM, so it can act on it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence


def stop_group(proc: subprocess.Popen, grace_s: float, pids: Sequence[int] = (),
               poll_s: float = 0.05) -> int:
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
    while time.monotonic() < deadline and (_group_alive(pgid) or any(map(_running, targets))):
        proc.poll()             # reap the leader, or it stays in the group as a zombie
        time.sleep(poll_s)
    _killpg(pgid, signal.SIGKILL)
    for pid in targets:
        if _running(pid):
            _kill(pid, signal.SIGKILL)
    return proc.wait()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no port or file)."""
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
