"""TCP ports on this machine: which are free, and free ones to hand a new server."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Where Linux says which ports it hands to outgoing connections.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Below this sit the well-known servers a developer machine runs (databases, dev servers).
UNHANDED_LOW = 10000


def port_free(host: str, port: int) -> bool:
    """Whether a server could bind host:port right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A port free right now; another process may still take it before the server binds."""
    return pick_free_ports(1, host)[0]


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports: all sockets stay bound until every port is chosen.

    They come from outside the kernel's ephemeral range: a port asked of the kernel (bind to 0)
    is one it also hands to outgoing connections, so between the choice and the server's bind
    any client on the machine could take it (a soak's `up` failed so in CI)."""
    candidates = _unhanded_ports()
    sockets: list[socket.socket] = []
    try:
        for port in random.SystemRandom().sample(candidates, len(candidates)):
            if len(sockets) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
        if len(sockets) < count:
            raise OSError(f"fewer than {count} free ports on {host} outside the ephemeral range")
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _unhanded_ports() -> list[int]:
    """Ports from 10000 up to where the kernel's ephemeral range begins; past its end (up to 65000,
    where profiles' ports stop) only where it begins too low to leave room below."""
    try:
        low, high = (int(word) for word in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default, where the range cannot be read
    below = range(UNHANDED_LOW, low)
    return list(below) if len(below) >= 1000 else list(range(max(high + 1, UNHANDED_LOW), 65001))


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket bound to host:port and listening: connections queue in its backlog (up to
    `backlog`) until a server accepts them. OSError when the address is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock
