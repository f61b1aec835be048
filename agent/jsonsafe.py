"""JSON for numbers that may be NaN or Inf: the event log's, the ledger's, a checkpoint's extras.

json.dumps(json_safe({"loss": float("nan")}))     # '{"loss": "nan"}'
json_number("nan")                                 # nan
"""

from __future__ import annotations

import math
from typing import Any


def json_safe(value: Any, *, strict: str | None = None, keep_nonfinite: bool = False) -> Any:
    """A copy of ``value`` that JSON can hold: tuples as lists, non-finite floats as the strings
    "nan", "inf", "-inf" (read back with ``json_number``).

    Args:
        value: numbers, strings, lists, tuples and dicts, nested.
        strict: None leaves other objects as they are (a log writes them with ``str``); else
            the name of ``value`` for the TypeError raised on a non-string key or an object JSON
            cannot hold.
        keep_nonfinite: keep NaN/Inf as floats (Python's json reads them back as floats, which
            a scheduler's ``best = inf`` needs).
    """
    if isinstance(value, float) and not math.isfinite(value) and not keep_nonfinite:
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [
            json_safe(v, strict=strict and f"{strict}[{i}]", keep_nonfinite=keep_nonfinite)
            for i, v in enumerate(value)
        ]
    if isinstance(value, dict):
        if strict and (bad := next((k for k in value if not isinstance(k, str)), None)) is not None:
            raise TypeError(f"{strict} has the non-string key {bad!r}")
        return {
            k: json_safe(v, strict=strict and f"{strict}[{k!r}]", keep_nonfinite=keep_nonfinite)
            for k, v in value.items()
        }
    if strict:
        raise TypeError(
            f"{strict} holds a {type(value).__name__}, which JSON cannot hold "
            "(numbers, strings, lists, dicts with string keys)"
        )
    return value


def json_number(x: Any) -> float:
    """A number as ``json_safe`` wrote it ("nan", "inf" included); NaN for anything else."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan
