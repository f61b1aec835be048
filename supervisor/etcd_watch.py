"""One range of etcd's keys followed through the gateway's streaming watch, in a thread.

    watch = RangeWatch(store, key=b64("job/"), range_end=b64("job/nodes/"), sink=part)
    watch.start()        # read the range, then follow it: part.reset(...), part.apply(...)
    watch.close()

``POST /v3/watch`` with ``{"create_request": {"key", "range_end", "start_revision"}}`` answers
one JSON object per line for as long as the store keeps it open: ``{"result": {"header":
{"revision"}, "created": true}}`` first, then ``{"result": {"header", "events": [{"type":
"DELETE", "kv": {...}, "prev_kv": {...}}]}}`` per change (proto3 JSON leaves a PUT's type out:
it is the zero value), and, when the revision asked for was compacted away, ``{"result":
{"canceled": true, "compact_revision": r}}`` on a stream the gateway leaves open. A failed
stream (the store gone, a refused token) is ``{"error": {"grpc_code", "message"}}`` or a closed
connection.

Each (re)start reads the whole range (one Range, at revision R) and watches from R + 1, so
nothing changes unseen between the two; after an error, a server close or a compaction the
sink is told it is stale (``lost``) until the next read. The sink is the only state: this
module knows nothing of jobs.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from .etcd import Entry, EtcdStore, StoreError, Stream, entry_of

log = logging.getLogger("torchvitals.supervisor")

_UNAUTHENTICATED = 16

_AGAIN_S = 0.05
"""The wait before reading a range again after a clean end (no hot loop on a store that
closes every stream at once)."""


@dataclass(frozen=True)
class WatchEvent:
    """One change of one key."""

    deleted: bool
    entry: Entry
    """The key as written (a DELETE: its key and the revision of the delete, no value)."""
    previous: Entry | None = None
    """The key before the change (asked with ``prev_kv``; None for a key just created)."""


@dataclass(frozen=True)
class WatchResponse:
    """One object of the stream."""

    revision: int
    """The store's revision as of this response."""
    events: tuple[WatchEvent, ...] = ()
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    """Nonzero: the revision asked for was compacted; this one is the oldest still kept."""


class WatchError(StoreError):
    """The stream said it failed (``unauthenticated``: etcd refused the token)."""

    def __init__(self, message: str, *, unauthenticated: bool = False) -> None:
        super().__init__(message)
        self.unauthenticated = unauthenticated


def parse(line: bytes | str) -> WatchResponse:
    """One line of the stream.

    Raises:
        WatchError: the line is the stream's error, or not an object of etcd's.
    """
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise WatchError(f"the watch stream sent {str(line)[:200]!r}: {exc}") from None
    if not isinstance(data, dict):
        raise WatchError(f"the watch stream sent {data!r}")
    if "error" in data:
        error = data["error"] if isinstance(data["error"], dict) else {"message": data["error"]}
        code = error.get("grpc_code", error.get("code"))
        raise WatchError(
            f"the watch stream failed: {error.get('message', error)}",
            unauthenticated=code == _UNAUTHENTICATED,
        )
    result: dict[str, Any] = data.get("result", {})
    return WatchResponse(
        revision=int(result.get("header", {}).get("revision", 0)),
        events=tuple(_event(e) for e in result.get("events", ())),
        created=bool(result.get("created", False)),
        canceled=bool(result.get("canceled", False)),
        compact_revision=int(result.get("compact_revision", 0)),
    )


def responses(lines: Iterable[bytes]) -> Iterator[WatchResponse]:
    """The stream's responses, blank lines skipped, until it ends."""
    for line in lines:
        if line.strip():
            yield parse(line)


def _event(event: dict[str, Any]) -> WatchEvent:
    previous = event.get("prev_kv")
    return WatchEvent(
        deleted=event.get("type") == "DELETE",
        entry=entry_of(event["kv"]),
        previous=None if previous is None else entry_of(previous),
    )


class WatchSink(Protocol):
    """What a watch keeps up to date (``job_view.RangePart``)."""

    def reset(self, entries: list[Entry], revision: int) -> None:
        """The whole range, read at ``revision``."""

    def apply(self, response: WatchResponse) -> None:
        """Changes after the last ``reset`` or ``apply``."""

    def lost(self) -> None:
        """The watch broke: what the sink holds may be stale until the next ``reset``."""


class RangeWatch:
    """Follows ``[key, range_end)`` (base64) of ``store`` into ``sink`` from a daemon thread.

    Args:
        store: the store (its URL, TLS and token).
        key, range_end: the range, base64 as the gateway takes it.
        sink: told of every read and change.
        filters: etcd's ``NOPUT`` / ``NODELETE``: changes the store need not send.
        prev_kv: each event carries the key as it was before.
        retry_s: the wait before reconnecting after a failure.
    """

    def __init__(
        self,
        store: EtcdStore,
        *,
        key: str,
        range_end: str,
        sink: WatchSink,
        filters: tuple[str, ...] = (),
        prev_kv: bool = False,
        retry_s: float = 1.0,
    ) -> None:
        self.store, self.key, self.range_end, self.sink = store, key, range_end, sink
        self.filters, self.prev_kv, self.retry_s = filters, prev_kv, retry_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stream: Stream | None = None
        self._thread: threading.Thread | None = None
        self.connects = 0
        """How many times the range was read and its watch opened (1 while nothing failed)."""

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, daemon=True, name="torchvitals-supervisor-watch"
        )
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop following: the open stream is shut, the thread joined."""
        self._stop.set()
        self._shut()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.sink.lost()

    def reconnect(self) -> None:
        """The stream may be dead without knowing it (a network cut that no packet reported,
        which TCP notices only after minutes): shut it, and the thread reads the range again
        and watches anew (the sink is told it is stale until then)."""
        self._shut()

    def _run(self) -> None:
        failed = None
        while not self._stop.is_set():
            wait_s = _AGAIN_S  # the store closed the stream, or compacted: read again now
            try:
                self._follow()
                failed = None
            except (StoreError, OSError, http.client.HTTPException) as exc:
                if isinstance(exc, WatchError) and exc.unauthenticated:
                    self.store.forget_token(self.store.token)
                if str(exc) != failed:  # once per kind of failure, not per retry
                    failed = str(exc)
                    log.info("torchvitals supervise: the store's watch broke: %s", exc)
                wait_s = self.retry_s
            finally:
                self._shut()
            self.sink.lost()
            self._stop.wait(wait_s)

    def _follow(self) -> None:
        """Read the range, then apply its changes until the stream ends or is canceled."""
        entries, revision = self.store.snapshot(self.key, self.range_end)
        request: dict[str, Any] = {
            "key": self.key,
            "range_end": self.range_end,
            "start_revision": str(revision + 1),
        }
        if self.filters:
            request["filters"] = list(self.filters)
        if self.prev_kv:
            request["prev_kv"] = True
        stream = self.store.stream("/v3/watch", {"create_request": request})
        with self._lock:
            self._stream = stream
        if self._stop.is_set():
            return
        self.connects += 1
        for response in responses(_lines(stream)):
            self.store.revisions.saw(response.revision)
            if response.canceled or response.compact_revision:
                # Compacted past what the range was read at: read it again.
                log.info(
                    "torchvitals supervise: the store compacted its history to revision %d; "
                    "reading the job's keys again",
                    response.compact_revision,
                )
                return
            if response.created:
                self.sink.reset(entries, revision)  # live from here: the watch holds
                continue
            self.sink.apply(response)

    def _shut(self) -> None:
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


def _lines(stream: Stream) -> Iterator[bytes]:
    while True:
        line = stream.readline()
        if not line:
            return
        yield line
