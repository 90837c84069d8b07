"""Networking helpers shared by every layer (process-group rendezvous, KV transfer, the served app, tests)."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` ("" = every interface). The window before the caller binds
    it is accepted: the OS hands out ephemeral ports in a random order, so a collision needs another
    process to take this exact one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
