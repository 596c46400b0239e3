"""TCP ports on this machine: which are free, and free ones to hand a new server."""

from __future__ import annotations

import socket


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
    """`count` distinct free ports: all sockets stay bound until every port is chosen."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


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
