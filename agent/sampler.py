"""Resumable, skip-aware batches: a global batch position that lives in the checkpoint.

    for batch in agent.batches(loader):      # the loader as you have it, every epoch
        ...

Every batch drawn from the loader gets the next global index, across epochs. A batch whose
index lies in a skipped range is drawn and dropped (never trained on); after a process restart
the batches before the checkpoint's position are drawn and dropped too, so the job continues at
the right sample as long as the loader yields the same sequence again (a seeded sampler, e.g.
``DistributedSampler`` with ``set_epoch``). Every rank counts the same indices, so every rank
skips the same steps.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator


class SkipAwareBatches:
    """The global batch counter, the skip list and the resume point."""

    def __init__(self, position: int = 0, skipped: Iterable[tuple[int, int]] = ()):
        self.drawn = 0
        """Batches drawn from the loader by this process, plus those before a resume point."""
        self.resume_at = position
        self.skipped: list[tuple[int, int]] = [tuple(r) for r in skipped]
        self.used = False

    @property
    def position(self) -> int:
        """Global index of the next batch to draw (what a checkpoint stores)."""
        return max(self.drawn, self.resume_at)

    def is_skipped(self, index: int) -> bool:
        return any(start <= index < stop for start, stop in self.skipped)

    def skip(self, start: int, stop: int) -> None:
        """Never yield the batches with global index in [start, stop)."""
        if stop > start:
            self.skipped.append((start, stop))

    def skipped_count(self) -> int:
        return sum(stop - start for start, stop in self.skipped)

    def iterate(self, loader: Iterable[Any]) -> Iterator[Any]:
        """One pass over ``loader``, dropping batches consumed before a resume or skipped."""
        self.used = True
        for batch in loader:
            index = self.drawn
            self.drawn += 1
            if index < self.resume_at or self.is_skipped(index):
                continue
            yield batch
