"""Reading torchrun's reports of failed workers from its stderr, passed on byte for byte.

python -m pytest tests/unit/test_launcher_log.py
"""

from __future__ import annotations

import os
import threading
import time

from torchvitals.supervisor.launcher_log import FailureLines, LauncherLog

# torchrun 2.13's stderr when rank 1 of two exits 13 (--max-restarts 0): the elastic agent's log
# line, then the summary whose root cause names the global rank.
TORCHRUN_EXIT13 = """\
W1202 14:06:40.684000 6384 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 6480 closing signal SIGTERM
E1202 14:06:40.688000 6384 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 13) local_rank: 1 (pid: 6481) of binary: /root/.pyenv/versions/3.11.7/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
w.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_14:06:40
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 6480)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 6480
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_14:06:40
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : 13 (pid: 6481) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""  # noqa: E501, W291
TORCHRUN_KILLED = (
    "E1202 14:06:43.299000 6571 site-packages/torch/distributed/elastic/multiprocessing/"
    "api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 6700) of binary: /usr/bin/python3"
)
# torch.multiprocessing's start method (``torchrun --no-python``-less function entrypoints).
MULTIPROCESSING = (
    "E1202 14:06:43.299000 6571 api.py:837] failed (exitcode: 1) local_rank: 2 (pid: 42) of fn: "
    "main (start_method: spawn)"
)


def test_the_log_line_and_the_root_cause_name_the_worker_its_status_and_its_rank():
    lines = FailureLines(clock=lambda: 5.0)
    found = [f for f in map(lines.feed, TORCHRUN_EXIT13.splitlines()) if f is not None]
    assert [(f.exitcode, f.local_rank, f.pid) for f in found] == [(13, 1, 6481), (13, 1, 6481)]
    failure = lines.failures[6481]
    # The log line is kept as the evidence; the summary adds the global rank it lacks.
    assert failure.rank == 3 and failure.line.startswith("E1202 14:06:40.688000 6384")
    assert failure.seen_at == 5.0
    # The SIGTERMed rank 0 is listed among the failures, not as the root cause: not read.
    assert set(lines.failures) == {6481}


def test_a_killed_worker_and_a_multiprocessing_worker_are_read_too():
    lines = FailureLines()
    killed = lines.feed(TORCHRUN_KILLED)
    assert killed is not None and (killed.exitcode, killed.local_rank, killed.pid) == (-9, 0, 6700)
    spawned = lines.feed(MULTIPROCESSING)
    assert spawned is not None and (spawned.exitcode, spawned.pid) == (1, 42)
    assert lines.feed("step 12 loss 3.2 exitcode is fine") is None


def test_every_byte_goes_on_unchanged_and_the_failure_is_read_on_the_way():
    read_end, write_end = os.pipe()
    out_read, out_write = os.pipe()
    noise = b"\x1b[31mcolour\x1b[0m\rprogress 50%\rprogress 100%\n" + b"x" * 100_000 + b"\n"
    payload = noise + TORCHRUN_EXIT13.encode() + b"no newline at the end"
    copied = bytearray()

    def drain() -> None:  # our stderr's reader (a terminal, a log collector)
        while chunk := os.read(out_read, 1 << 16):
            copied.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    with os.fdopen(read_end, "rb", buffering=0) as stream:
        log = LauncherLog(stream, out=out_write)
        os.write(write_end, payload[:70_000])
        os.write(write_end, payload[70_000:])
        os.close(write_end)
        started = time.monotonic()
        log.close(timeout_s=5)
        assert time.monotonic() - started < 1  # the end of the pipe ends the copy
    os.close(out_write)
    reader.join(timeout=5)
    os.close(out_read)
    assert bytes(copied) == payload
    assert log.failures()[6481].exitcode == 13
