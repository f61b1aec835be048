"""Python stacks on a signal, for whoever watches the rank from outside (the supervisor).

    TORCHVITALS_HEARTBEAT_DIR=/tmp/job/attempt-0002 torchrun ... train.py
    kill -s "$(( $(kill -l RTMIN) + 5 ))" <pid>    # every thread's stack -> stack-rank00003.txt

A rank that stopped advancing cannot be asked where it is: it spins in user code, waits in a
collective, or is stopped. ``faulthandler`` answers from the signal handler itself, without the
interpreter's cooperation (no Python code runs, the GIL is not needed), so the supervisor gets
the spinning frame or the collective the rank waits in. Registered at ``watch()`` when a
heartbeat folder is set, on ``protocol.STACK_SIGNAL`` (a real-time signal: SIGUSR1 and SIGUSR2
are taken by launchers and Lightning), appending to ``protocol.stack_path(folder, rank)``; the
heartbeat names the signal, so nothing is sent to a rank that registered none (a real-time
signal's default action ends the process).

A user's own handler of that signal keeps running: when one was installed before (from Python,
or a C handler Python cannot name), the registration chains to it (``chain=True``). Never to
the default action, which would end the process right after the dump. ``faulthandler`` itself
keeps one registration per signal, so a user's own ``faulthandler.register`` of the same signal,
which cannot be seen from here, would be replaced while the agent is open and is not restored
after: register yours after ``watch()``, or on another signal.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
from typing import IO

from ...protocol import STACK_SIGNAL, stack_path

log = logging.getLogger(__name__)

_holder: StackDumps | None = None
"""The open registration of this process (faulthandler keeps one per signal): a second agent
in the process takes it over, and gives it back when it closes first."""


class StackDumps:
    """Every thread's Python stack, appended to the rank's stack file on ``signum``.

    Args:
        folder: the heartbeat folder.
        rank: the rank, as its heartbeat names it.
        signum: the signal (default ``protocol.STACK_SIGNAL``).

    Raises:
        OSError: the stack file cannot be opened (``open`` turns it into None).
    """

    def __init__(self, folder: str | os.PathLike, rank: int, signum: int) -> None:
        global _holder
        self.signum = signum
        self.path = stack_path(folder, rank)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._previous = _holder
        # Chaining to SIG_DFL would re-raise into the default action: the end of the process.
        # (Over another agent's registration, the handler before it is the one chained to.)
        self._chain: bool = (
            self._previous._chain
            if self._previous is not None
            else signal.getsignal(signum) != signal.SIG_DFL
        )
        try:
            faulthandler.register(signum, file=self._file, all_threads=True, chain=self._chain)
        except BaseException:
            self._file.close()
            self._file = None
            raise
        _holder = self

    @classmethod
    def open(cls, folder: str | os.PathLike, rank: int) -> StackDumps | None:
        """The registration, or None where it cannot be (no real-time signals on this platform,
        an unwritable folder, not the main interpreter): logged, and ``watch()`` goes on."""
        if STACK_SIGNAL is None:
            return None
        try:
            return cls(folder, rank, int(STACK_SIGNAL))
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning(
                "torchvitals: cannot register the stack dump on signal %d (%s); a hang of "
                "rank %d will be named without its stack",
                STACK_SIGNAL,
                exc,
                rank,
            )
            return None

    @property
    def active(self) -> bool:
        return self._file is not None

    def close(self) -> None:
        """Unregister (or give the signal back to the agent that held it before), close the
        file; safe to call twice."""
        global _holder
        file, self._file = self._file, None
        if file is None:
            return
        if _holder is self:
            previous = self._previous
            while previous is not None and not previous.active:
                previous = previous._previous
            if previous is not None and previous._file is not None:
                faulthandler.register(
                    previous.signum, file=previous._file, all_threads=True, chain=previous._chain
                )
            else:
                faulthandler.unregister(self.signum)
            _holder = previous
        with contextlib.suppress(OSError):
            file.close()
