"""One simulated node's wall clock, ``MULTINODE_TEST_CLOCK_SKEW_S`` seconds off the machine's:
imported at the start of every Python process of that node (its supervisor, its torchrun, its
ranks) by putting this folder first on their ``PYTHONPATH``.

    MULTINODE_TEST_CLOCK_SKEW_S=30 PYTHONPATH=tests/multinode/skewed_clock:... torchvitals ...

What torchvitals reads of a host's clock is shifted: ``time.time`` and ``time.time_ns`` (every
unix time it writes or compares, the heartbeats' included) and psutil's process start times (the
kernel's boot time plus the start ticks: the same host clock, compared with a heartbeat's time to
tell a reused pid). Monotonic clocks and sleeps stay the machine's, as they are on a real host.
``datetime.now`` is left alone: torchvitals does not read it, and torch's c10d rendezvous does,
comparing the nodes' readings with each other (its keep-alive), which a skew of 30 s breaks
before the job starts. libfaketime is not used: it breaks CPython's sleeps here.
"""

from __future__ import annotations

import os
import time

SKEW_S = float(os.environ.get("MULTINODE_TEST_CLOCK_SKEW_S", "0") or 0)

if SKEW_S:
    _time, _time_ns = time.time, time.time_ns
    _skew_ns = round(SKEW_S * 1e9)

    def _skewed_time() -> float:
        return _time() + SKEW_S

    def _skewed_time_ns() -> int:
        return _time_ns() + _skew_ns

    time.time = _skewed_time
    time.time_ns = _skewed_time_ns

    try:
        import psutil
    except ImportError:  # a process without psutil reads no start time
        psutil = None
    if psutil is not None:
        _create_time = psutil.Process.create_time

        def _skewed_create_time(self: psutil.Process) -> float:
            return _create_time(self) + SKEW_S

        psutil.Process.create_time = _skewed_create_time  # type: ignore[method-assign]
