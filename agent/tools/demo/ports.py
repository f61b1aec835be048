"""Free ports on 127.0.0.1 for the demo's ranks (the gloo master, the metrics servers), picked
below the kernel's ephemeral range. Imports no torch, so tests and tools that only need a port
load nothing else.
"""

from __future__ import annotations

import random
import socket

HOST = "127.0.0.1"


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def listen_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """Ports to listen on that no outgoing connection takes: those below the kernel's ephemeral
    range. A free port inside that range can be taken by any connect() (a gloo pair, a scrape)
    between the moment it is picked and the moment the server binds it."""
    try:
        with open(path) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return (10000, low) if low > 11000 else (low // 2, low)


def free_ports(count: int, rng: random.Random | None = None) -> int:
    """A base port with ``count`` consecutive free ports on 127.0.0.1 (rank r serves base + r)."""
    rng = rng or random.Random()
    low, high = listen_port_range()
    for _ in range(200):
        base = rng.randrange(low, high - count)
        if all(port_is_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found on {HOST}")
