"""A free loopback port for a process this one starts (a node, a router, a redis-server, a
rank's rendezvous), chosen before that process binds it.

A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, where every outgoing
connection and every other ``bind(0)`` on the machine draws its ports too: between this choice
and the child's bind, any of them may take it (tests running side by side saw routers fail
with "address already in use"). So the port is drawn below that range, where only explicit
binds go, and checked free by binding it once. Where the range cannot be read (not Linux), or
no port below it is free, it falls back to ``bind(0)``.
"""

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000  # below this, the well-known and registered services people run
TRIES = 64


def ephemeral_start() -> int | None:
    """The first port of the kernel's ephemeral range; None where it cannot be read."""
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing is bound to now and that no ``bind(0)`` or outgoing
    connection is handed before the caller's child binds it (the module's docstring)."""
    start = ephemeral_start()
    if start is not None and start > LOWEST:
        for port in random.sample(range(LOWEST, start), min(TRIES, start - LOWEST)):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
