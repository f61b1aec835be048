"""A free port on 127.0.0.1 for a test's server, picked below the kernel's ephemeral range.

    from support.ports import free_port

A port picked by binding port 0 comes from that range, where any outgoing connection (a gloo
pair, a scrape, an etcd client) can take it before the server binds it: a launch then fails with
EADDRINUSE. Imports no torch.
"""

from __future__ import annotations

from torchvitals.agent.tools.demo.ports import free_ports


def free_port() -> int:
    """A free port below the ephemeral range, so no outgoing connection takes it first."""
    return free_ports(1)
