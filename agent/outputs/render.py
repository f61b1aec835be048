"""The rendered /metrics text, cached between steps: renders follow the steps, not the scrapes.

    cache = RenderCache(render, version)      # render(accept) -> (bytes, content type)
    body, content_type = cache.get(accept)

The text is rendered again only after a new step (the exporter's version changed) or, for the
host vitals read at render time, after ``min_interval_s``; however fast a client scrapes, the
exporter renders at most once a step and once a ``min_interval_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

MIN_RENDER_INTERVAL_S = 1.0


class RenderCache:
    """The exposition bytes per content type, rendered again when the exporter's version changed
    (a new step) or ``min_interval_s`` passed (host vitals are read at render time)."""

    def __init__(
        self,
        render: Callable[[str], tuple[bytes, str]],
        version: Callable[[], int],
        min_interval_s: float = MIN_RENDER_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._render, self._version, self._clock = render, version, clock
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[int, float, bytes, str]] = {}
        self.renders = 0
        """How many times the text was rendered (tests: bounded by steps, not scrapes)."""

    def get(self, accept: str) -> tuple[bytes, str]:
        with self._lock:
            version, now = self._version(), self._clock()
            hit = self._cache.get(accept)
            if hit is not None and hit[0] == version and now - hit[1] < self.min_interval_s:
                return hit[2], hit[3]
            body, content_type = self._render(accept)
            self.renders += 1
            self._cache[accept] = (version, now, body, content_type)
            if len(self._cache) > 8:  # a client cycling Accept headers stays bounded
                self._cache.pop(next(iter(self._cache)))
            return body, content_type
