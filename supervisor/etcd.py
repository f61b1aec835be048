"""The few etcd v3 calls the supervisors agree through, over etcd's HTTP/JSON gateway.

    store = EtcdStore("https://10.0.0.5:2379", tls=StoreTLS(cafile="ca.crt", certfile="c.crt",
                      keyfile="c.key"), user="torchvitals", password=secret)
    lease = store.grant(30); store.put("k", "v", lease=lease); store.keepalive(lease)
    store.create("k2", "v", lease=lease)   # True only for the first writer
    store.get("k2"), store.prefix("k"), store.delete_prefix("k")

etcd is a rendezvous backend torchrun itself supports, so a multi-node job may already run one;
its gateway (``/v3/kv/...``, keys and values base64, on the client port) needs no client
library and no torch: the supervisor stays torch-free. Every call is one short POST; a store
that does not answer, or refuses us, raises ``StoreError`` with what to set.

Hand-written rather than ``etcd3gw``: that client brings requests, futurist and pbr, and has no
user/password authentication at all, which a store that can end a job (its ``final`` key) needs.
TLS is the standard library's (a CA to verify the store, a client certificate for etcd's
``--client-cert-auth``); auth is etcd's own: ``/v3/auth/authenticate`` turns the user and
password into a token sent as the ``Authorization`` header, fetched again when etcd says it
expired (simple tokens live ``--auth-token-ttl`` seconds unused, and only on the member that
issued them).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from ..errors import TorchvitalsError

log = logging.getLogger("torchvitals.supervisor")

T = TypeVar("T")

_UNAUTHENTICATED = 16
"""gRPC's code for an invalid or expired token, which the gateway passes on."""


class StoreError(TorchvitalsError, OSError):
    """The store did not answer, refused us, or answered something that is not etcd's."""


@dataclass(frozen=True)
class Entry:
    """One key of the store."""

    key: str
    value: str
    mod_revision: int
    """The store's revision of the key's last change (for a compare-and-swap)."""
    lease: int = 0
    """The lease the key lives by (0: none, it stays)."""
    version: int = 0
    """How many times the key was written since it was created (1: once)."""


@dataclass(frozen=True)
class StoreTLS:
    """How to reach an ``https://`` store; every file is PEM."""

    cafile: str | None = None
    """CA bundle that signed the store's certificate (None: the system's)."""
    certfile: str | None = None
    """Client certificate, for a store started with ``--client-cert-auth``."""
    keyfile: str | None = None
    """Key of ``certfile``."""

    def context(self) -> ssl.SSLContext:
        """The client context; a file that cannot be read raises ``StoreError`` naming it."""
        if (self.certfile is None) != (self.keyfile is None):
            raise StoreError("store_certfile and store_keyfile go together: set both or neither")
        try:
            context = ssl.create_default_context(cafile=self.cafile)
        except (OSError, ssl.SSLError) as exc:
            raise StoreError(
                f"store_cafile {self.cafile}: cannot be read as a CA bundle ({exc})"
            ) from None
        if self.certfile is not None:
            try:
                context.load_cert_chain(self.certfile, self.keyfile)
            except (OSError, ssl.SSLError) as exc:
                raise StoreError(
                    f"store_certfile {self.certfile} / store_keyfile "
                    f"{self.keyfile}: not a certificate and its key ({exc})"
                ) from None
        return context


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(b64: str) -> str:
    return base64.b64decode(b64).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix`` (etcd's convention)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


class RevisionClock:
    """A store revision (a key's ``mod_revision``) as a time on this node's clock: when this
    client first saw the store at that revision or later. Its own calls (a lease renewal at
    least) sample it, so the time lags the write by up to one of them; none at all (None)
    for a revision older than what it keeps.

    Args:
        wall: unix seconds.
        keep: samples kept (one per revision that moved).
    """

    def __init__(self, wall: Callable[[], float] = time.time, keep: int = 256) -> None:
        self._wall = wall
        self._samples: deque[tuple[int, float]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def saw(self, revision: int) -> None:
        """The store answered at ``revision`` now."""
        with self._lock:
            if revision and (not self._samples or revision > self._samples[-1][0]):
                self._samples.append((revision, self._wall()))

    def at(self, revision: int) -> float | None:
        """When this client first saw ``revision`` (or a later one), in unix seconds."""
        with self._lock:
            dropped = len(self._samples) == self._samples.maxlen
            if not self._samples or (dropped and revision <= self._samples[0][0]):
                return None  # seen before the oldest sample kept: when is not known
            for seen, at in self._samples:
                if seen >= revision:
                    return at
        return None


class EtcdStore:
    """Args:
        url: the client URL, ``http://host:2379`` or ``https://host:2379``.
        timeout_s: seconds each call may take.
        tls: CA and client certificate for an ``https://`` URL (None: the system's CAs, no
            client certificate).
        user, password: etcd's authentication (both or neither).

    Raises:
        StoreError: a TLS file cannot be read, TLS is given for an ``http://`` URL, or only one
            of the user and the password is.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 5.0,
        *,
        tls: StoreTLS | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        if not self.url.startswith(("http://", "https://")):
            raise StoreError(f"store_url {url!r}: must start with http:// or https://")
        https = self.url.startswith("https://")
        if tls is not None and tls != StoreTLS() and not https:
            raise StoreError(
                f"store_url {url!r}: a CA or client certificate needs an https:// store_url"
            )
        self._context = (tls or StoreTLS()).context() if https else None
        if bool(user) != (password is not None):
            raise StoreError(
                "store_user and its password go together: set store_user and "
                "store_password_file (or TORCHVITALS_SUPERVISOR_STORE_PASSWORD)"
            )
        self.user, self._password = user or None, password
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self.revisions = RevisionClock()
        """When this client first saw each revision of the store (every answer says it)."""

    def grant(self, ttl_s: float) -> int:
        """A new lease of ``ttl_s`` seconds (at least 1); its id."""
        return int(self._call("/v3/lease/grant", {"TTL": max(1, round(ttl_s))})["ID"])

    def keepalive(self, lease: int) -> bool:
        """Renew ``lease``; False when it has already expired (its keys are gone)."""
        result = self._call("/v3/lease/keepalive", {"ID": str(lease)}).get("result", {})
        return int(result.get("TTL", 0)) > 0

    def ttl(self, lease: int) -> int:
        """Seconds ``lease`` has left (-1: it expired or never was)."""
        return int(self._call("/v3/lease/timetolive", {"ID": str(lease)}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: its keys go at once (a clean exit is not a lost node). A lease
        already gone (expired, or revoked by another node) is no error: it is what was asked."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease)})
        except StoreError as exc:
            if "lease not found" not in str(exc):
                raise

    def put(self, key: str, value: str, lease: int = 0) -> int:
        """Set ``key`` (bound to ``lease`` when given: it goes when the lease expires).

        Returns:
            The store's revision of this write (the key's ``mod_revision``): every write to the
            store has its own, in the order the store applied them, whoever wrote.
        """
        answer = self._call("/v3/kv/put", _put(key, value, lease))
        return int(answer.get("header", {}).get("revision", 0))

    def get(self, key: str) -> Entry | None:
        """The key, or None."""
        kvs = self._call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return entry_of(kvs[0]) if kvs else None

    def prefix(self, prefix: str) -> list[Entry]:
        """Every key starting with ``prefix``, sorted by key."""
        kvs = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return [entry_of(kv) for kv in kvs.get("kvs", [])]

    def count(self, prefix: str) -> int:
        """How many keys start with ``prefix`` (the store sends the number, not the keys)."""
        answer = self._call(
            "/v3/kv/range",
            {"key": _b64(prefix), "range_end": _prefix_end(prefix), "count_only": True},
        )
        return int(answer.get("count", 0))

    def snapshot(self, key: str, range_end: str) -> tuple[list[Entry], int]:
        """Every key in ``[key, range_end)`` (both base64, as a watch takes them), and the
        store's revision they are read at: a watch from that revision + 1 misses nothing."""
        answer = self._call("/v3/kv/range", {"key": key, "range_end": range_end})
        revision = int(answer.get("header", {}).get("revision", 0))
        return [entry_of(kv) for kv in answer.get("kvs", [])], revision

    def stream(self, path: str, body: dict[str, Any]) -> Stream:
        """Open one of the gateway's streaming calls (``/v3/watch``): its answer, a JSON
        object per line, for as long as the store keeps it open. The socket has no read
        timeout (a quiet watch is no failure) but TCP keep-alives, so a store that vanished
        ends the stream within ~30 s; ``Stream.close`` ends it from another thread."""
        return self._authorized(path, lambda token: self._open_stream(path, body, token))

    def _open_stream(self, path: str, body: dict[str, Any], token: str | None) -> Stream:
        parts = urllib.parse.urlsplit(self.url)
        connection: http.client.HTTPConnection
        if self._context is not None:
            connection = http.client.HTTPSConnection(
                parts.netloc, timeout=self.timeout_s, context=self._context
            )
        else:
            connection = http.client.HTTPConnection(parts.netloc, timeout=self.timeout_s)
        where = f"etcd at {self.url}{path}"
        try:
            connection.request("POST", path, json.dumps(body), self._headers(token))
            sock = connection.sock  # the response may take the connection over
            response = connection.getresponse()
        except OSError as exc:
            connection.close()
            raise StoreError(f"{where}: {exc}{_tls_hint(exc)}") from None
        if response.status != 200:
            text = response.read().decode(errors="replace")[:300]
            connection.close()
            self._refused(where, response.status, text)
        assert sock is not None
        _keep_probing(sock)
        sock.settimeout(None)
        return Stream(sock, response)

    def delete(self, key: str) -> int:
        """Remove ``key`` alone; how many keys went (0 or 1)."""
        answer = self._call("/v3/kv/deleterange", {"key": _b64(key)})
        return int(answer.get("deleted", 0))

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix``; how many there were."""
        answer = self._call(
            "/v3/kv/deleterange", {"key": _b64(prefix), "range_end": _prefix_end(prefix)}
        )
        return int(answer.get("deleted", 0))

    def create(self, key: str, value: str, lease: int = 0) -> bool:
        """Set ``key`` only if it does not exist; whether this call set it."""
        return self.create_at(key, value, lease) is not None

    def create_at(self, key: str, value: str, lease: int = 0) -> int | None:
        """Set ``key`` only if it does not exist: the store's revision of the write, or None
        when the key was there (another writer came first, in the store's order)."""
        return self._txn(
            {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"},
            key,
            value,
            lease,
        )

    def swap(self, key: str, value: str, mod_revision: int, lease: int = 0) -> bool:
        """Set ``key`` only if it is unchanged since ``mod_revision``; whether this call set it.
        A put binds the key to ``lease`` anew (0: to none), so pass the lease it lives by."""
        written = self._txn(
            {
                "key": _b64(key),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": str(mod_revision),
            },
            key,
            value,
            lease,
        )
        return written is not None

    def _txn(self, compare: dict[str, str], key: str, value: str, lease: int) -> int | None:
        """The put if ``compare`` holds: its revision, else None."""
        answer = self._call(
            "/v3/kv/txn",
            {"compare": [compare], "success": [{"request_put": _put(key, value, lease)}]},
        )
        if not answer.get("succeeded", False):  # proto3 JSON leaves false out
            return None
        return int(answer.get("header", {}).get("revision", 0))

    # ------------------------------------------------------------ the wire

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._authorized(path, lambda token: self._post(path, body, token))

    def _authorized(self, path: str, send: Callable[[str | None], T]) -> T:
        """``send`` with this client's token (None without auth), once more with a new token
        when etcd says it expired."""
        token = self._authenticated() if self.user else None
        try:
            return send(token)
        except _Unauthenticated as exc:
            if token is None:
                raise StoreError(f"etcd at {self.url}{path}: {exc}") from None
        # The token expired (or another member issued it): one new one, one retry.
        log.info(
            "torchvitals supervise: the store's token for user %r expired; authenticating again",
            self.user,
        )
        self.forget_token(token)
        try:
            return send(self._authenticated())
        except _Unauthenticated as exc:
            raise StoreError(f"etcd at {self.url}{path}: {exc}") from None

    def _authenticated(self) -> str:
        """The token for ``user``, fetched when there is none yet."""
        with self._auth_lock:
            if self._token is None:
                try:
                    answer = self._post(
                        "/v3/auth/authenticate",
                        {"name": self.user, "password": self._password},
                        None,
                    )
                except (StoreError, _Unauthenticated) as exc:
                    raise StoreError(
                        f"etcd at {self.url}: authentication as store_user "
                        f"{self.user!r} failed: {exc}"
                    ) from None
                if not answer.get("token"):
                    raise StoreError(
                        f"etcd at {self.url}: no token for store_user {self.user!r}"
                        " (is authentication enabled on the store?)"
                    )
                self._token = str(answer["token"])
            return self._token

    def forget_token(self, token: str | None) -> None:
        """etcd refused ``token`` (expired, or issued by another member): the next call
        authenticates again."""
        with self._auth_lock:
            if self._token == token:
                self._token = None

    @property
    def token(self) -> str | None:
        return self._token

    def _headers(self, token: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token  # etcd's gateway: the bare token, no scheme
        return headers

    def _post(self, path: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers=self._headers(token)
        )
        where = f"etcd at {self.url}{path}"
        try:
            with urllib.request.urlopen(
                request, timeout=self.timeout_s, context=self._context
            ) as response:
                answer = json.loads(response.read().decode() or "{}")
        except urllib.error.HTTPError as exc:
            self._refused(where, exc.code, exc.read().decode(errors="replace")[:300])
        except (OSError, ValueError) as exc:
            # urllib wraps a failed connection; a refusal read after the handshake comes bare.
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise StoreError(f"{where}: {reason}{_tls_hint(reason)}") from None
        if not isinstance(answer, dict) or "error" in answer:
            raise StoreError(f"{where}: {answer}")
        self.revisions.saw(int(answer.get("header", {}).get("revision", 0)))
        return answer

    def _refused(self, where: str, status: int, text: str) -> NoReturn:
        """An HTTP error from the gateway, as ``_Unauthenticated`` or a ``StoreError``."""
        try:
            error = json.loads(text)
        except ValueError:
            error = {}
        message = (
            str(error.get("message") or error.get("error") or text)
            if isinstance(error, dict)
            else text
        )
        if isinstance(error, dict) and error.get("code") == _UNAUTHENTICATED:
            raise _Unauthenticated(message) from None
        raise StoreError(f"{where}: HTTP {status}: {message}{_hint(message, self.user)}") from None


class Stream:
    """An open streaming answer: its lines as they come, and a ``close`` any thread may call
    (a read blocked in another returns at once, with nothing)."""

    def __init__(self, sock: socket.socket, response: http.client.HTTPResponse) -> None:
        self._sock, self._response = sock, response
        self._closed = False

    def readline(self) -> bytes:
        """The next line; empty once the stream ended (or was closed)."""
        try:
            return self._response.readline()
        except (AttributeError, ValueError, OSError):
            if self._closed:  # http.client, its socket shut under it, fails in odd ways
                return b""
            raise

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # already closed
            self._sock.shutdown(socket.SHUT_RDWR)
        self._response.close()
        self._sock.close()


class _Unauthenticated(Exception):
    """etcd refused the token (or its absence): invalid or expired."""


def _keep_probing(sock: socket.socket) -> None:
    """TCP keep-alives on a stream's socket: a store that vanished without closing it (its
    machine gone) ends the stream after ~10 s idle + 4 probes 5 s apart, not never."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _hint(message: str, user: str | None) -> str:
    """What to set, for the refusals whose fix is ours."""
    if not user and any(
        m in message for m in ("user name is empty", "user name not found", "permission denied")
    ):
        return (
            " (the store requires authentication: set store_user and store_password_file, "
            "or TORCHVITALS_SUPERVISOR_STORE_PASSWORD)"
        )
    if "permission denied" in message:
        return (
            f" (store_user {user!r} needs read and write permission on the prefix "
            "torchvitals/jobs/)"
        )
    if "CommonName of client" in message:
        # etcd's gateway cannot pass a certificate's CN on as the user, so with auth on it
        # refuses any client certificate that has one.
        return " (with etcd's auth on, store_certfile must be issued without a Common Name)"
    if "HTTP request to an HTTPS server" in message:
        return " (the store speaks TLS: use an https:// store_url)"
    return ""


def _tls_hint(reason: object) -> str:
    if isinstance(reason, ssl.SSLCertVerificationError):
        return " (set store_cafile to the CA that signed the store's certificate)"
    if isinstance(reason, (ssl.SSLError, ConnectionResetError)) or "certificate" in str(reason):
        return (
            " (the TLS handshake failed: a store started with --client-cert-auth needs "
            "store_certfile and store_keyfile signed by its trusted CA)"
        )
    return ""


def _put(key: str, value: str, lease: int) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return body


def entry_of(kv: dict[str, Any]) -> Entry:
    return Entry(
        key=_text(kv["key"]),
        value=_text(kv.get("value", "")),
        mod_revision=int(kv.get("mod_revision", 0)),
        lease=int(kv.get("lease", 0)),
        version=int(kv.get("version", 0)),
    )
