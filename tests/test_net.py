"""parallel/net.py free_port: ports below the OS's ephemeral range, never twice, never one held elsewhere."""
from __future__ import annotations

import random
import socket

from parallel import net


def test_free_ports_come_from_below_the_ephemeral_range_and_never_twice():
    ports = [net.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(net.LOWEST_PORT <= p < net._ephemeral_start() for p in ports)


def test_a_port_held_on_any_interface_is_skipped(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", 0))  # on every interface, as a server that binds [::] or 0.0.0.0 holds it
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken, *range(20000, 20200)])  # the held port first, then others
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        monkeypatch.setattr(net, "_ephemeral_start", lambda: 65536)
        monkeypatch.setattr(net, "LOWEST_PORT", 1024)
        assert net.free_port() != taken
