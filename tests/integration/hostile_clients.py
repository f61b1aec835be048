"""Clients that break the rules of HTTP and TLS, for the /metrics server's tests; run as a
process, a seeded random mix of them against a plain and a TLS port.

    python tests/integration/hostile_clients.py --plain 9401 --tls 9402 --seed 7 --seconds 2.5

The mix (``KINDS``): well-behaved GETs, half requests, connect-and-reset (SO_LINGER 0), readers
that never read the answer, garbage, oversized heads, idle connections, a TLS ClientHello on the
plain port and plain HTTP on the TLS port, half ClientHellos, requests followed by an immediate
close. Each thread draws from its own ``random.Random(seed, thread)``, so a seed replays the same
sequence of actions (the interleaving is the scheduler's). Only 127.0.0.1, only bounded: every
socket has a timeout, each thread stops after ``--seconds`` or ``--actions``, and holds at most
``--hold`` sockets. Prints one JSON line of counts; exits 1 if a client raised anything but a
network error (an attacker that crashed would test nothing).

The helpers (``self_signed``, ``client_hello``, ``reset``, ``REQUEST``) serve the tests too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import random
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

HOST = "127.0.0.1"
REQUEST = b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\nAccept: text/plain\r\n\r\n"
TIMEOUT_S = 2.0
"""Every client socket's timeout: no action can hang a thread for longer."""


def self_signed(directory: Path) -> tuple[str, str]:
    """A throwaway EC certificate for 127.0.0.1 and its key (PEM files in ``directory``): with
    the ``cryptography`` package if installed, else the ``openssl`` command."""
    cert, key = directory / "server.pem", directory / "server.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return str(cert), str(key)
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))]),
            critical=False,
        )
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert), str(key)


def trusting() -> ssl.SSLContext:
    """A TLS client context that checks nothing (no CA bundle to load: it is cheap)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return ctx


def client_hello() -> bytes:
    """The bytes a real TLS client sends first (made in memory: no connection)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = trusting().wrap_bio(incoming, outgoing, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def reset(sock: socket.socket) -> None:
    """Close with an RST, not a FIN (SO_LINGER 0): what a crashed or impatient client does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(TIMEOUT_S)
        if rcvbuf:  # before connecting: the window is agreed at the handshake
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect((HOST, port))
    except BaseException:
        sock.close()
        raise
    return sock


class Attacker:
    """One thread's share of the mix: its own random stream, the sockets it holds open."""

    def __init__(
        self, rng: random.Random, plain: int, tls: int, hold: int, hello: bytes, ctx: ssl.SSLContext
    ) -> None:
        self.rng, self.plain, self.tls, self.hold = rng, plain, tls, hold
        self.hello, self.ctx = hello, ctx
        self.held: list[socket.socket] = []
        self.outcomes: Counter[str] = Counter()

    # -- the kinds: (attacker, port, on_tls_port) -> None; network errors are the point ---------

    def good(self, port: int, tls: bool) -> None:
        with self._open(port, tls) as sock:
            sock.sendall(REQUEST)
            answer = _read_all(sock)
        self.outcomes["good 200" if answer.startswith(b"HTTP/1.0 200") else "good refused"] += 1

    def half_request(self, port: int, tls: bool) -> None:
        sock = self._open(port, tls)
        sock.sendall(REQUEST[: self.rng.randrange(1, len(REQUEST) - 3)])
        self._keep(sock)

    def connect_reset(self, port: int, tls: bool) -> None:
        sock = connect(port)
        if self.rng.random() < 0.5:
            sock.sendall((REQUEST if not tls else self.hello)[: self.rng.randrange(1, 40)])
        reset(sock)

    def slow_reader(self, port: int, tls: bool) -> None:
        sock = self._open(port, tls, rcvbuf=4096)
        sock.sendall(REQUEST)
        self._keep(sock)  # never reads the answer

    def garbage(self, port: int, tls: bool) -> None:
        sock = self._open(port, tls) if self.rng.random() < 0.3 else connect(port)
        sock.sendall(self.rng.randbytes(self.rng.randrange(1, 4096)))
        self._keep(sock)

    def oversized(self, port: int, tls: bool) -> None:
        with self._open(port, tls) as sock:
            if self.rng.random() < 0.5:
                head = (
                    b"GET /metrics HTTP/1.0\r\nX-Pad: "
                    + b"a" * self.rng.randrange(17000, 70000)
                    + b"\r\n\r\n"
                )
            else:
                # Over 100 headers, under or over the server's head limit.
                many = self.rng.randrange(150, 3000)
                head = b"GET /metrics HTTP/1.0\r\n" + b"X-H: 1\r\n" * many + b"\r\n"
            sock.sendall(head)
            _read_all(sock)

    def idle(self, port: int, tls: bool) -> None:
        self._keep(connect(port))

    def send_close(self, port: int, tls: bool) -> None:
        sock = self._open(port, tls)
        sock.sendall(REQUEST)
        if self.rng.random() < 0.5 and not tls:
            sock.shutdown(socket.SHUT_WR)
        sock.close()

    def wrong_protocol(self, port: int, tls: bool) -> None:
        with connect(port) as sock:
            if tls:  # plain HTTP on the TLS port
                sock.sendall(REQUEST)
                _read_all(sock)
            else:  # a TLS client on the plain port, soon impatient
                sock.settimeout(0.3)
                with contextlib.suppress(OSError, ssl.SSLError):
                    self.ctx.wrap_socket(sock).close()

    def half_hello(self, port: int, tls: bool) -> None:
        sock = connect(port)
        sock.sendall(self.hello[: self.rng.randrange(1, len(self.hello))])
        self._keep(sock)

    KINDS: ClassVar[dict[str, tuple[float, Callable[..., None]]]] = {
        "good": (3.0, good),
        "half_request": (1.0, half_request),
        "connect_reset": (1.5, connect_reset),
        "slow_reader": (1.0, slow_reader),
        "garbage": (1.0, garbage),
        "oversized": (0.5, oversized),
        "idle": (1.5, idle),
        "send_close": (1.0, send_close),
        "wrong_protocol": (1.0, wrong_protocol),
        "half_hello": (0.7, half_hello),
    }
    """Name -> (weight, action)."""

    def run(self, deadline: float, actions: int) -> None:
        names = list(self.KINDS)
        weights = [self.KINDS[n][0] for n in names]
        try:
            for _ in range(actions):
                if time.monotonic() >= deadline:
                    break
                name = self.rng.choices(names, weights)[0]
                tls = self.rng.random() < 0.5
                try:
                    self.KINDS[name][1](self, self.tls if tls else self.plain, tls)
                    self.outcomes[name] += 1
                except OSError:  # ssl.SSLError and timeouts too: the server said no
                    self.outcomes[name + " refused"] += 1
                time.sleep(self.rng.uniform(0.0, 0.02))
        finally:
            for sock in self.held:
                self._let_go(sock)

    def _open(self, port: int, tls: bool, rcvbuf: int | None = None) -> socket.socket:
        sock = connect(port, rcvbuf)
        if not tls:
            return sock
        try:
            return self.ctx.wrap_socket(sock)
        except BaseException:
            sock.close()
            raise

    def _keep(self, sock: socket.socket) -> None:
        self.held.append(sock)
        while len(self.held) > self.hold:
            self._let_go(self.held.pop(self.rng.randrange(len(self.held))))

    def _let_go(self, sock: socket.socket) -> None:
        if self.rng.random() < 0.3:
            reset(sock)
        else:
            sock.close()


def _read_all(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    data = b""
    try:
        while len(data) < limit:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", type=int, required=True, help="the plain HTTP port")
    parser.add_argument("--tls", type=int, required=True, help="the HTTPS port")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=2.5)
    parser.add_argument("--threads", type=int, default=6)
    parser.add_argument("--actions", type=int, default=300, help="per thread, at most")
    parser.add_argument("--hold", type=int, default=16, help="sockets held open per thread")
    args = parser.parse_args()
    hello, ctx = client_hello(), trusting()
    attackers = [
        Attacker(random.Random(f"{args.seed}/{i}"), args.plain, args.tls, args.hold, hello, ctx)
        for i in range(args.threads)
    ]
    deadline = time.monotonic() + args.seconds
    crashed: list[str] = []

    def run(attacker: Attacker) -> None:
        try:
            attacker.run(deadline, args.actions)
        except BaseException as exc:  # not a network error: the attacker is broken
            crashed.append(repr(exc))

    threads = [threading.Thread(target=run, args=(a,)) for a in attackers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.seconds + 30)
    total: Counter[str] = sum((a.outcomes for a in attackers), Counter())
    print(
        json.dumps(
            {
                "outcomes": dict(sorted(total.items())),
                "crashed": crashed,
                "hung": sum(t.is_alive() for t in threads),
            }
        )
    )
    return 1 if crashed or any(t.is_alive() for t in threads) else 0


if __name__ == "__main__":
    sys.exit(main())
