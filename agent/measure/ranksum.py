"""Which ranks raised a flag, told from three summed floats whatever the world size.

    summed = [flag, rank * flag, rank² * flag] summed over the ranks   # one slot of the SUM
    count, ranks = decode(*summed)

Each rank adds ``[f, r·f, r²·f]`` for its flag ``f`` (0 or 1) to the step's SUM vector, so the
reduction that already runs carries, in three floats at any world size, how many ranks flagged
(the sum of the flags), and which: one rank's number is the sum of ``r·f``; two ranks' ``a`` and
``b`` follow from ``a + b`` and ``a² + b²``. Three or more are counted, not named: their sums
do not determine them, and naming the lowest would be a guess. (At 16,384 ranks ``r²`` is below
2.7e8: float64 sums of them are exact.) The straggler flags and the non-finite loss use it.
"""

from __future__ import annotations

import math

SLOTS = 3
"""Floats a flag takes in the SUM: flag, rank·flag, rank²·flag."""


def encode(rank: int, flag: float) -> list[float]:
    """``[flag, rank·flag, rank²·flag]``: what one rank adds for its flag (0 or 1)."""
    r = float(rank)
    return [flag, r * flag, r * r * flag]


def powers(rank: int) -> list[float]:
    """``[1, rank, rank²]``: a device flag times these is ``encode`` without leaving the device."""
    r = float(rank)
    return [1.0, r, r * r]


def decode(count: float, ranks: float, squares: float) -> tuple[int, list[int]]:
    """How many ranks flagged, and which when that can be told.

    Args:
        count, ranks, squares: the summed ``encode`` slots.

    Returns:
        ``(n, named)``: ``named`` holds the one or two ranks exactly (ascending); it is empty
        when none or three and more flagged (``n`` says how many).
    """
    n = round(count)
    if n <= 0:
        return 0, []
    if n == 1:
        return 1, [round(ranks)]
    if n == 2:
        # a + b = s and a² + b² = q  =>  a, b = (s ∓ sqrt(2q - s²)) / 2
        d = math.sqrt(max(2.0 * squares - ranks * ranks, 0.0))
        return 2, [round((ranks - d) / 2), round((ranks + d) / 2)]
    return n, []
