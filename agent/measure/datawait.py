"""Data wait: how long a step waited for its batch, told apart from the time spent computing.

    for batch in agent.batches(loader):       # timed here, around each draw from the loader
    agent.record_data_wait(seconds)           # or said by whoever draws the batches (an adapter)

The wait of a step is everything recorded since the previous ``agent.step`` returned: a slow
disk, too few DataLoader workers, workers that died and are being replaced. A step's time minus
its wait is compute; a rank that is slow with a long wait has a data problem, one slow without
it a compute (or host) problem.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any


class DataWait:
    """Accumulates the seconds this rank waited for data until the next step takes them.

    Args:
        clock: the monotonic clock the agent times steps with.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._seconds = 0.0

    def record(self, seconds: float) -> None:
        """Add ``seconds`` of waiting to the current step (negative or NaN values are refused).

        Args:
            seconds: time the training loop spent waiting for its next batch.
        """
        seconds = float(seconds)
        if not seconds >= 0:
            raise ValueError(f"data wait must be >= 0 seconds, got {seconds}")
        self._seconds += seconds

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Times its body as data wait."""
        start = self._clock()
        try:
            yield
        finally:
            self._seconds += self._clock() - start

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Yield ``batches``' items, adding the time each draw took to the wait.

        Two clock reads per batch; the draw of a batch that is dropped (a skipped one) counts
        too, since the step waited for it.
        """
        it = iter(batches)
        while True:
            start = self._clock()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                self._seconds += self._clock() - start
            yield item

    def take(self) -> float:
        """The wait since the last ``take``, and start counting the next step's."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds
