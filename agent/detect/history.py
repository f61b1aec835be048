"""The detector's verdict history, bounded: the first verdict of each (pattern, block, rank)
and the most recent ones.

    history = VerdictHistory()          # what ``Detector.history`` is
    history.extend(emitted)             # every step
    list(history)                       # oldest first
    history[-100:]                      # the newest 100 (what a checkpoint keeps)

A critical verdict is emitted every step it holds, so a run that skips a NaN step after step
for a day would keep ~10^5 of them. Its readers need a bounded part: ``diagnose()`` orders the
symptom classes by the first verdict of each pattern, names the culprit from the first verdict
that names a rank and shows the earliest line per (pattern, block), all first verdicts of some
(pattern, block, rank); a checkpoint keeps the newest 100; the framework integrations hand the
history to the user at the end. So each key's first verdict is kept for the whole run (the keys
are bounded: patterns x (blocks + ranks)), and the newest ``recent`` verdicts beside them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from .verdict import Verdict

RECENT = 1000
"""Newest verdicts kept besides the firsts: ten times what a checkpoint keeps (100)."""


def identity(v: Verdict) -> tuple[str, str | None, Any]:
    """What makes two verdicts the same finding: (pattern, block, rank). A straggler has no
    block but one verdict per rank."""
    return (v.pattern, v.block, v.evidence.get("rank"))


class VerdictHistory(Sequence[Verdict]):
    """Every verdict emitted so far, oldest first, less those that are neither among the newest
    ``recent`` nor the first of their (pattern, block, rank).

    Args:
        recent: how many of the newest verdicts are kept.
    """

    def __init__(self, recent: int = RECENT) -> None:
        if recent < 1:
            raise ValueError(f"VerdictHistory keeps at least 1 recent verdict, got {recent}")
        self._recent: deque[tuple[bool, Verdict]] = deque(maxlen=recent)
        """(first of its key, verdict), newest last."""
        self._firsts: list[Verdict] = []
        """First verdicts of their key that left ``_recent``, oldest first: all older than it."""
        self._seen: set[tuple[str, str | None, Any]] = set()

    def append(self, verdict: Verdict) -> None:
        """Add the newest verdict."""
        key = identity(verdict)
        first = key not in self._seen
        self._seen.add(key)
        if len(self._recent) == self._recent.maxlen:
            leaving_first, leaving = self._recent[0]
            if leaving_first:
                self._firsts.append(leaving)
        self._recent.append((first, verdict))

    def extend(self, verdicts: Iterable[Verdict]) -> None:
        """Add verdicts, oldest first."""
        for verdict in verdicts:
            self.append(verdict)

    def __iter__(self) -> Iterator[Verdict]:
        yield from self._firsts
        yield from (verdict for _, verdict in self._recent)

    def __reversed__(self) -> Iterator[Verdict]:
        return reversed(list(self))

    def __len__(self) -> int:
        return len(self._firsts) + len(self._recent)

    @overload
    def __getitem__(self, index: int) -> Verdict: ...

    @overload
    def __getitem__(self, index: slice) -> list[Verdict]: ...

    def __getitem__(self, index: int | slice) -> Verdict | list[Verdict]:
        # Read rarely (a checkpoint's newest 100, a test's last verdict): a copy is cheap at
        # this size and keeps the order in one place, ``__iter__``.
        return list(self)[index]

    def __repr__(self) -> str:
        return f"VerdictHistory({list(self)!r})"
