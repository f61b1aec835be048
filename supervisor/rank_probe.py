"""Looking at a hung job's ranks from outside: their process states and their Python stacks.

    findings = probe_ranks(folder, node=1, host="h", wait_s=2.0)   # before the group is stopped
    proc_state(4711)              # "R", "S", "D", "T", "t", "Z", or None when gone
    parse_stack(text)             # (frames of the training thread innermost first, waiting, frame)

Nothing here needs the rank's cooperation: the state is the kernel's (``/proc/<pid>/stat``), and
the stack is ``faulthandler``'s, written by the rank's own signal handler on the signal its
heartbeat names (``protocol.STACK_SIGNAL``, registered at ``watch()``), which runs whatever the
interpreter is doing: spinning in Python, blocked in a collective in C. A stopped rank is not
signalled (it cannot answer until continued, and continuing it would destroy the evidence); a
rank that registered no signal is never sent one (a real-time signal's default action ends the
process).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from ..protocol import RankBeat, read_rank_beats, stack_path
from .rank_findings import GONE, STACK_EXCERPT_FRAMES, STOPPED_STATES, RankFinding

STACK_READ_MAX_BYTES = 256 * 1024
"""Most of a stack file read after one signal (every thread of a busy rank fits)."""

SETTLE_S = 0.05
"""A stack file that grew and then did not change for this long is complete (faulthandler writes
a dump in one burst of small writes)."""

PID_REUSE_SLACK_S = 2.0
"""A process that started this long after a rank's heartbeat was written is not that rank (the
boot time and the start are known to a clock tick; the heartbeat's time is the rank's clock)."""

COLLECTIVE_PATHS = (
    "/torch/distributed/",
    "/torch/nn/parallel/",
    "/torch/autograd/",
    "/torch/cuda/",
)
"""Frames in these files mean the rank waits on the others or on its device: a collective, a
backward whose gradients DDP reduces, a device synchronize (a framework's own communication
layer calls torch.distributed, whose frame is innermost)."""

COLLECTIVE_FUNCTIONS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "monitored_barrier",
        "init_process_group",
        "new_group",
        "synchronize",
    }
)
"""Functions that wait for the others, whatever file wraps them."""

_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+.*:\s*$|^Stack \(most recent")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*?)\s*$')
_LIBRARY = tuple(
    p
    for p in {
        sysconfig.get_paths().get("stdlib"),
        sysconfig.get_paths().get("platstdlib"),
        sys.prefix,
        sys.base_prefix,
    }
    if p
)


def proc_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``...), or
    None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def proc_started(pid: int) -> float | None:
    """Unix seconds ``pid`` started, or None when there is no such process."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def exit_status(pid: int) -> int | None:
    """How a zombie ``pid`` ended, before its parent reaps it: its exit status (>= 0) or minus
    the signal that killed it; None when it is not a zombie (or the kernel does not say: field
    52 of ``/proc/<pid>/stat``, Linux 3.5 and later)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "Z" or len(fields) < 50:
        return None
    with contextlib.suppress(ValueError):
        return os.waitstatus_to_exitcode(int(fields[49]))
    return None


def frame_text(file: str, line: str | int, func: str) -> str:
    """A frame as faulthandler and Python's tracebacks print it."""
    return f'File "{file}", line {line} in {func}'


def parse_stack(text: str) -> tuple[list[tuple[str, str, str]], bool | None, str | None]:
    """Read a faulthandler dump (every thread of one rank).

    Returns:
        (frames, waiting, frame): the training thread's frames (file, line, function),
        innermost first; whether any of them waits on the others (a collective, a backward
        under DDP, a device synchronize; None: no frame at all); where it is: the innermost
        frame it waits in, else its innermost frame of user code (not the standard library,
        not an installed package), else its innermost frame.
    """
    threads: list[list[tuple[str, str, str]]] = []
    for line in text.splitlines():
        if _HEADER.match(line):
            threads.append([])
            continue
        match = _FRAME.match(line)
        if match:
            if not threads:
                threads.append([])
            threads[-1].append((match["file"], match["line"], match["func"]))
    threads = [t for t in threads if t]
    if not threads:
        return [], None, None
    frames = _training_thread(threads)
    wait = next((f for f in frames if _waits(f)), None)
    if wait is not None:
        return frames, True, frame_text(*wait)
    user = next((f for f in frames if not _library(f[0])), frames[0])
    return frames, False, frame_text(*user)


def _training_thread(threads: list[list[tuple[str, str, str]]]) -> list[tuple[str, str, str]]:
    """The thread that runs the training loop: the one a script or ``python -m`` started (its
    outermost frame is ``<module>`` or runpy's), else the deepest."""
    main = [t for t in threads if t[-1][2] == "<module>" or t[-1][0].endswith("runpy.py")]
    return max(main or threads, key=len)


def _waits(frame: tuple[str, str, str]) -> bool:
    file, _, func = frame
    path = file.replace("\\", "/")
    return any(p in path for p in COLLECTIVE_PATHS) or func in COLLECTIVE_FUNCTIONS


def _library(file: str) -> bool:
    return (
        "/site-packages/" in file
        or "/dist-packages/" in file
        or file.startswith("<")
        or any(file.startswith(p + os.sep) for p in _LIBRARY)
    )


def excerpt(frames: list[tuple[str, str, str]], limit: int = STACK_EXCERPT_FRAMES) -> str:
    """The innermost ``limit`` frames, one per line, innermost first."""
    return "\n".join(frame_text(*f) for f in frames[:limit])


def probe_ranks(
    folder: Path,
    *,
    node: int,
    host: str,
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    wall: Callable[[], float] = time.time,
) -> tuple[RankFinding, ...]:
    """Every rank of ``folder`` (the attempt's heartbeat folder) as it is now: its state and
    heartbeat age first (before anything is sent), then, for each rank neither stopped nor gone
    that registered a stack signal, the stack it writes on that signal (waiting up to
    ``wait_s`` for all).

    Args:
        wall: unix seconds of this host, the clock the ranks write their heartbeats with: a
            heartbeat's age is a difference of two readings of one host's clock.

    Returns:
        One finding per rank, by rank.
    """
    beats = read_rank_beats(folder)
    read_at = wall()
    states = {rank: _state(b) for rank, b in beats.items()}
    asked: dict[int, tuple[Path, int]] = {}
    for rank, beat in sorted(beats.items()):
        state = states[rank]
        if beat.stack_signal is None or state in (None, "Z", *STOPPED_STATES):
            continue
        path = stack_path(folder, rank)
        size = _size(path)
        try:
            os.kill(beat.pid, beat.stack_signal)
        except OSError:  # gone meanwhile, or not ours
            continue
        asked[rank] = (path, size)
    stacks = _collect(asked, wait_s, clock, sleep) if asked else {}
    return tuple(
        _finding(beats[r], states[r], r in asked, stacks.get(r, ""), node, host, read_at)
        for r in sorted(beats)
    )


def _state(beat: RankBeat) -> str | None:
    """The rank's process state; None when it is gone, or when its pid now names a process
    started after the rank's last heartbeat (the pid was reused: never signal a stranger)."""
    state = proc_state(beat.pid)
    started = proc_started(beat.pid) if state is not None else None
    if started is not None and started > beat.time + PID_REUSE_SLACK_S:
        return None
    return state


def _finding(
    beat: RankBeat,
    state: str | None,
    asked: bool,
    text: str,
    node: int,
    host: str,
    read_at: float,
) -> RankFinding:
    frames, waiting, frame = parse_stack(text)
    return RankFinding(
        rank=beat.rank,
        node=node,
        host=host,
        pid=beat.pid,
        step=beat.step,
        beat_time=beat.time,
        beat_age_s=max(0.0, read_at - beat.time),
        state=GONE if state in (None, "Z") else state,
        asked=asked,
        stack=excerpt(frames),
        waiting=waiting,
        frame=frame,
    )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _collect(
    asked: dict[int, tuple[Path, int]],
    wait_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> dict[int, str]:
    """What each asked rank appended to its stack file: waits until every file grew and then
    held still for ``SETTLE_S``, or ``wait_s`` passed."""
    deadline = clock() + wait_s
    last = {rank: size for rank, (_, size) in asked.items()}
    still: dict[int, float] = {}
    while True:
        now = clock()
        for rank, (path, _) in asked.items():
            size = _size(path)
            if size != last[rank]:
                last[rank], still[rank] = size, now
        done = all(last[r] > asked[r][1] and now - still.get(r, now) >= SETTLE_S for r in asked)
        if done or now >= deadline:
            break
        sleep(0.02)
    out = {}
    for rank, (path, before) in asked.items():
        if last[rank] <= before:
            continue
        with contextlib.suppress(OSError), open(path, "rb") as f:
            f.seek(before)
            out[rank] = f.read(STACK_READ_MAX_BYTES).decode("utf-8", errors="replace")
    return out
