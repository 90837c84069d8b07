"""Networking helpers shared by every layer (process-group rendezvous, KV transfer, the served app, tests)."""
from __future__ import annotations

import random
import socket

# Ports are drawn from [LOWEST_PORT, the OS's ephemeral range): above the well-known ports and Ray's worker
# ports (10002-19999 by default), and below every port the OS hands to a bind of port 0. Ray starts many
# processes that bind port 0; had we taken our port from that same range, one of them could be handed it
# between our check and the caller's bind (seen in CI: `tandem serve`'s gRPC port, "Failed to bind").
LOWEST_PORT = 20000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_handed_out: set[int] = set()  # this process never returns one port twice (two calls in a row, say)


def _ephemeral_start() -> int:
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "") -> int:
    """A TCP port free right now on `host` ("" = every IPv4 interface, the default: a server that binds
    all interfaces, as gRPC's does on [::], fails on a port another process holds on any one address).
    Drawn below the ephemeral range (LOWEST_PORT says why); where that range leaves no room, the OS picks."""
    draw = random.SystemRandom()
    low, high = LOWEST_PORT, _ephemeral_start()
    if high - low >= 100:
        for _ in range(200):
            port = draw.randrange(low, high)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
