"""The few etcd v3 calls the supervisors agree through, over etcd's HTTP/JSON gateway.

    store = EtcdStore("http://10.0.0.5:2379")
    lease = store.grant(30); store.put("k", "v", lease=lease); store.keepalive(lease)
    store.create("k2", "v")          # True only for the first writer
    store.get("k2"), store.prefix("k")

etcd is a rendezvous backend torchrun itself supports, so a multi-node job may already run one;
its gateway (``/v3/kv/...``, keys and values base64, on the client port) needs no client
library and no torch: the supervisor stays torch-free. Every call is one short POST; a store
that does not answer raises ``StoreError``.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from ...errors import TorchvitalsError


class StoreError(TorchvitalsError, OSError):
    """The store did not answer, or answered something that is not etcd's."""


@dataclass(frozen=True)
class Entry:
    """One key of the store."""

    key: str
    value: str
    mod_revision: int
    """The store's revision of the key's last change (for a compare-and-swap)."""
    lease: int = 0
    """The lease the key lives by (0: none, it stays)."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(b64: str) -> str:
    return base64.b64decode(b64).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix`` (etcd's convention)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


class EtcdStore:
    """Args:
        url: the client URL, ``http://host:2379``.
        timeout_s: seconds each call may take.
    """

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def grant(self, ttl_s: float) -> int:
        """A new lease of ``ttl_s`` seconds (at least 1); its id."""
        return int(self._call("/v3/lease/grant", {"TTL": max(1, round(ttl_s))})["ID"])

    def keepalive(self, lease: int) -> bool:
        """Renew ``lease``; False when it has already expired (its keys are gone)."""
        result = self._call("/v3/lease/keepalive", {"ID": str(lease)}).get("result", {})
        return int(result.get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: its keys go at once (a clean exit is not a lost node)."""
        self._call("/v3/lease/revoke", {"ID": str(lease)})

    def put(self, key: str, value: str, lease: int = 0) -> None:
        """Set ``key`` (bound to ``lease`` when given: it goes when the lease expires)."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self._call("/v3/kv/put", body)

    def get(self, key: str) -> Entry | None:
        """The key, or None."""
        kvs = self._call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _entry(kvs[0]) if kvs else None

    def prefix(self, prefix: str) -> list[Entry]:
        """Every key starting with ``prefix``, sorted by key."""
        kvs = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return [_entry(kv) for kv in kvs.get("kvs", [])]

    def create(self, key: str, value: str) -> bool:
        """Set ``key`` only if it does not exist; whether this call set it."""
        return self._txn({"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                          "create_revision": "0"}, key, value)

    def swap(self, key: str, value: str, mod_revision: int) -> bool:
        """Set ``key`` only if it is unchanged since ``mod_revision``; whether this call set it."""
        return self._txn({"key": _b64(key), "target": "MOD", "result": "EQUAL",
                          "mod_revision": str(mod_revision)}, key, value)

    def _txn(self, compare: dict[str, str], key: str, value: str) -> bool:
        answer = self._call("/v3/kv/txn", {
            "compare": [compare],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}]})
        return bool(answer.get("succeeded", False))     # proto3 JSON leaves false out

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read().decode() or "{}")
        except urllib.error.HTTPError as exc:
            raise StoreError(f"etcd at {self.url}{path}: HTTP {exc.code}: "
                             f"{exc.read().decode(errors='replace')[:200]}") from None
        except (OSError, ValueError) as exc:
            raise StoreError(f"etcd at {self.url}{path}: {exc}") from None
        if not isinstance(answer, dict) or "error" in answer:
            raise StoreError(f"etcd at {self.url}{path}: {answer}")
        return answer


def _entry(kv: dict[str, Any]) -> Entry:
    return Entry(key=_text(kv["key"]), value=_text(kv.get("value", "")),
                 mod_revision=int(kv.get("mod_revision", 0)), lease=int(kv.get("lease", 0)))
