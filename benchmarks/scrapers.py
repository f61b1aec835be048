"""The processes benchmarks/scrape.py runs beside the training one: a flood of scrapes, and a
/metrics server of fixed bytes. Torch-free, so they start in a moment.

    python benchmarks/scrapers.py flood --clients 2 --rate 300
        stdin "PORT": scrape 127.0.0.1:PORT ("started" once the clients run); "stop": stop and
        print what they got as one JSON line; end of input: exit
    python benchmarks/scrapers.py serve --body FILE --content-type TYPE [--scrapes-per-s 2]
        serve FILE's bytes on a free port (printed) with that limit, until end of input

Each scrape is a new connection, as Prometheus makes it, that reads the whole answer. A client
keeps its pace (``--rate`` / ``--clients`` a second; 0: back to back); one that falls behind
catches up by one scrape at most, never in a burst.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections import Counter

from torchvitals.agent.outputs.ratelimit import ScrapeBudget, ScrapeLimit
from torchvitals.agent.outputs.render import RenderCache
from torchvitals.agent.outputs.server import MetricsServer

ACCEPT = "text/plain"
CLIENT_TIMEOUT_S = 10.0
"""A client's socket timeout: a server that never answers cannot hang the benchmark."""


def fetch(port: int) -> str:
    """One scrape on a new connection; its status, or the name of the error."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S) as sock:
            sock.sendall(
                f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: {ACCEPT}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            head = b""
            while chunk := sock.recv(65536):
                head = head or chunk[:32]
        return head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "empty"
    except OSError as exc:
        return type(exc).__name__


def client(port: int, per_s: float, stop: threading.Event, got: Counter[str]) -> None:
    """Scrape ``port`` ``per_s`` times a second (0: back to back) until ``stop``."""
    interval = 1.0 / per_s if per_s else 0.0
    due = time.monotonic()
    while not stop.is_set():
        got[fetch(port)] += 1
        due = max(due + interval, time.monotonic() - interval)
        wait = due - time.monotonic()
        if wait > 0:
            stop.wait(wait)


def flood(clients: int, rate: float) -> None:
    """For each port read from stdin, scrape it until "stop", then print what the clients got."""
    for line in sys.stdin:
        port = int(line)
        stop = threading.Event()
        got: list[Counter[str]] = [Counter() for _ in range(clients)]
        threads = [
            threading.Thread(target=client, args=(port, rate / clients, stop, g)) for g in got
        ]
        began = time.monotonic()
        for t in threads:
            t.start()
        print("started", flush=True)
        sys.stdin.readline()
        stop.set()
        for t in threads:
            t.join(CLIENT_TIMEOUT_S + 5)
        total: Counter[str] = sum(got, Counter())
        print(json.dumps({"answers": total, "seconds": time.monotonic() - began}), flush=True)


def serve(body: bytes, content_type: str, scrapes_per_s: float, burst: int) -> None:
    """``body`` on a MetricsServer with this limit (0: none); its port on stdout; until EOF."""
    limit = ScrapeLimit(scrapes_per_s=scrapes_per_s, burst=burst) if scrapes_per_s else None
    server = MetricsServer(
        RenderCache(lambda accept: (body, content_type), lambda: 0),
        "127.0.0.1",
        0,
        budget=None if limit is None else ScrapeBudget(limit),
    )
    try:
        print(server.port, flush=True)
        sys.stdin.read()
    finally:
        server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    roles = p.add_subparsers(dest="role", required=True)
    f = roles.add_parser("flood", help="scrape the ports read from stdin")
    f.add_argument("--clients", type=int, default=2)
    f.add_argument("--rate", type=float, default=300.0, help="scrapes a second in all (0: max)")
    s = roles.add_parser("serve", help="serve a file's bytes as /metrics")
    s.add_argument("--body", required=True, help="file holding the exposition text")
    s.add_argument("--content-type", required=True)
    s.add_argument("--scrapes-per-s", type=float, default=0.0, help="the limit (0: none)")
    s.add_argument("--burst", type=int, default=5)
    args = p.parse_args()
    if args.role == "flood":
        flood(args.clients, args.rate)
    else:
        with open(args.body, "rb") as fh:
            body = fh.read()
        serve(body, args.content_type, args.scrapes_per_s, args.burst)


if __name__ == "__main__":
    main()
