"""One job's keys in this node's memory, kept by the store's watches: what a running job's
supervisor reads at every poll instead of asking the store.

    view = JobView(store, "torchvitals/jobs/4711/")
    view.start()                         # two watches, each reads its range first
    if view.live:                        # every watch holds: the view is the store's
        view.get(prefix + "attempt"), view.prefix(prefix + "incidents/")
        view.departed()                  # {key: the record a node had when its key went}
    with view.follow(prefix + "reports/a0002/hang-a0002/") as reports:   # one more, for a while
        reports.live and reports.entries()   # every node's findings as they come
    view.close()

The job's keys a running node follows split into two ranges, one watch each, because a node
rewrites its record with its step once per lease renewal and nothing a running job decides
needs that value until the node is gone: ``attempt``, ``final`` and ``incidents/`` (every
change: a restart, the end, an incident being decided and its verdict); ``nodes/`` (deletes
only, each with the record as it was: a lost node is a delete that names itself). A running
job's steady state sends nothing on the streams. The nodes' findings and their ranks' deaths
sort after ``nodes/`` and are followed by no node: the one that gathers an incident's findings
follows that incident's reports alone, while it gathers (``follow``).

Under ``nodes/`` the view holds the keys present at the range's last read less those deleted
since; a node that appeared after it (a replacement) is not in it until ``reread``, which a
reader calls when a node seems missing: a loss is always confirmed by the store itself.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable

from .etcd import Entry, EtcdStore
from .etcd_watch import RangeWatch, WatchResponse

DELETE_WAIT_S = 0.02
"""How often a reader waiting for a delete the watch has yet to bring looks again."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _after(prefix: str) -> str:
    """The first key after every key starting with ``prefix``."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class RangePart:
    """What one watch keeps: its range's keys, and whether they are the store's now.

    Args:
        changed: called after every change (from the watch's thread).
        deletes_only: the watch sends deletes only (with the key's last value); writes after
            the last read are not seen.
    """

    def __init__(self, changed: Callable[[], None], *, deletes_only: bool = False) -> None:
        self._changed, self.deletes_only = changed, deletes_only
        self._lock = threading.Lock()
        self.entries: dict[str, Entry] = {}
        self.departed: dict[str, tuple[Entry, int]] = {}
        """Keys deleted since they were last seen present: their last value, and the
        revision of the delete."""
        self.revision = 0
        """The store's revision this part is at."""
        self.live = False
        self.vanishing: dict[str, Entry] = {}
        """Keys a read found gone before their delete reached the watch: the delete, older
        than the read, still brings their last value (``prev_kv``), which ``departed`` then
        holds; their value as last seen until it does."""

    def reset(self, entries: list[Entry], revision: int) -> None:
        with self._lock:
            if revision < self.revision and self.live:
                return  # an older read than the changes already applied
            fresh = {e.key: e for e in entries}
            for key, entry in self.entries.items():
                if key not in fresh and key not in self.departed:
                    self.vanishing[key] = entry
            for key in fresh:
                self.vanishing.pop(key, None)
            self.entries = fresh
            for key in self.entries:
                gone = self.departed.get(key)
                if gone is not None and gone[1] <= revision:
                    del self.departed[key]  # present again since it went
            self.revision, self.live = revision, True
        self._changed()

    def apply(self, response: WatchResponse) -> None:
        with self._lock:
            for event in response.events:
                key = event.entry.key
                if event.entry.mod_revision <= self.revision:
                    last = self.vanishing.pop(key, None)
                    if event.deleted and last is not None:  # the read saw only its absence
                        self.departed[key] = (event.previous or last, event.entry.mod_revision)
                    continue  # already in the last read
                self.vanishing.pop(key, None)
                if event.deleted:
                    # The value as the store had it (prev_kv), else as last read.
                    before = event.previous or self.entries.get(key)
                    self.entries.pop(key, None)
                    if before is not None:
                        self.departed[key] = (before, event.entry.mod_revision)
                else:
                    self.entries[key] = event.entry
                    self.departed.pop(key, None)
            # The events' own revisions, not the header's: a watch catching up sends old
            # events under a header at the store's newest revision.
            self.revision = max([self.revision, *(e.entry.mod_revision for e in response.events)])
        if response.events:
            self._changed()

    def lost(self) -> None:
        with self._lock:
            self.live = False
        self._changed()

    def give_up(self) -> None:
        """The deletes still awaited will not come (the watch read its range again past
        them): their keys departed with the value last seen."""
        with self._lock:
            for key, entry in self.vanishing.items():
                self.departed[key] = (entry, self.revision)
            self.vanishing.clear()

    def pending(self) -> bool:
        """Whether a delete a read found is still to reach the watch."""
        with self._lock:
            return bool(self.vanishing)

    def snapshot(self) -> tuple[dict[str, Entry], dict[str, tuple[Entry, int]]]:
        with self._lock:
            return dict(self.entries), dict(self.departed)


class JobView:
    """The keys of the job under ``prefix``, as the store's watches say they are now.

    Args:
        store: the job's store (its URL, TLS and token are the watches').
        prefix: the job's prefix, ``torchvitals/jobs/<job>/``.
        watch: makes each range's watch (a fake in tests).
    """

    def __init__(
        self,
        store: EtcdStore,
        prefix: str,
        *,
        watch: Callable[..., RangeWatch] = RangeWatch,
    ) -> None:
        self.store, self.job_prefix = store, prefix
        self._lock = threading.Lock()
        self.generation = 0
        """Counts the changes seen (a reader that saw generation g has seen them all)."""
        nodes = prefix + "nodes/"
        self._ranges = [
            (prefix, nodes, RangePart(self._changed)),
            (nodes, _after(nodes), RangePart(self._changed, deletes_only=True)),
        ]
        self._watch = watch
        self._watches = [
            watch(
                store,
                key=_b64(start),
                range_end=_b64(end),
                sink=part,
                filters=("NOPUT",) if part.deletes_only else (),
                prev_kv=part.deletes_only,
            )
            for start, end, part in self._ranges
        ]

    def start(self) -> None:
        for watch in self._watches:
            watch.start()

    def close(self) -> None:
        for watch in self._watches:
            watch.close()

    def reconnect(self) -> None:
        """Open every watch anew (the store failed another call: a stream cut silently would
        otherwise hold a stale view as live); until each has read its range again, the view
        is not live and readers ask the store."""
        for _, _, part in self._ranges:
            part.lost()
        for watch in self._watches:
            watch.reconnect()

    @property
    def live(self) -> bool:
        """Every watch holds: what the view says, the store says."""
        return all(part.live for _, _, part in self._ranges)

    def get(self, key: str) -> Entry | None:
        """The key as the view has it (under ``nodes/``: present as of the last read, or
        gone since)."""
        entries, _ = self._part(key).snapshot()
        return entries.get(key)

    def prefix(self, prefix: str) -> list[Entry]:
        """Every key starting with ``prefix``, sorted by key; ``prefix`` within one range."""
        entries, _ = self._part(prefix).snapshot()
        return [entries[k] for k in sorted(entries) if k.startswith(prefix)]

    def departed(
        self, *, wait_s: float = 0.0, sleep: Callable[[float], None] = time.sleep
    ) -> dict[str, tuple[Entry, int]]:
        """The ``nodes/`` keys deleted since last seen present: their last value, and the
        revision of the delete. ``wait_s``: first wait up to this long for the deletes a read
        found done but the watch has not brought yet (they carry the last value)."""
        part = self._ranges[1][2]
        waited = 0.0
        while waited < wait_s and part.live and part.pending():
            sleep(DELETE_WAIT_S)
            waited += DELETE_WAIT_S
        if wait_s and part.pending():
            part.give_up()  # a resync skipped those deletes: never wait for them again
        _, departed = part.snapshot()
        return departed

    def reread(self, prefix: str) -> list[Entry]:
        """Read ``prefix``'s range from the store now (a node seems missing: is it?), and keep
        what it says; the keys starting with ``prefix``.

        Raises:
            StoreError: the store did not answer.
        """
        start, end, part = next(r for r in self._ranges if r[0] <= prefix < r[1])
        entries, revision = self.store.snapshot(_b64(start), _b64(end))
        if part.live:  # a part whose watch is down takes only its watch's own read
            part.reset(entries, revision)
        return [e for e in entries if e.key.startswith(prefix)]

    def follow(self, prefix: str) -> Followed:
        """Follow the keys starting with ``prefix`` (outside the view's ranges) on a watch of
        their own until the ``with`` block ends: ``live`` once read, then every change."""
        part = RangePart(lambda: None)
        watch = self._watch(
            self.store,
            key=_b64(prefix),
            range_end=_b64(_after(prefix)),
            sink=part,
            filters=(),
            prev_kv=False,
        )
        return Followed(part, watch)

    def _part(self, key: str) -> RangePart:
        for start, end, part in self._ranges:
            if start <= key < end:
                return part
        raise KeyError(f"{key!r} is not a key of {self.job_prefix}")

    def _changed(self) -> None:
        with self._lock:
            self.generation += 1


class Followed:
    """One range followed for a while (``JobView.follow``): its keys as the watch has them."""

    def __init__(self, part: RangePart, watch: RangeWatch) -> None:
        self._part, self._watch = part, watch

    def __enter__(self) -> Followed:
        self._watch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._watch.close()

    @property
    def live(self) -> bool:
        """The watch holds: what it says, the store says."""
        return self._part.live

    def entries(self) -> list[Entry]:
        """Every key followed, sorted by key."""
        entries, _ = self._part.snapshot()
        return [entries[k] for k in sorted(entries)]
