"""The nodes one command talks to: a transport per node, opened on first use and closed together."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Self

from thunderctl.cluster.transport import LocalTransport, SshTarget, Transport


class Transports:
    """The open transports of one command, one per node, closed together at the end.

    Thread-safe: nodes are handled in parallel, and a node's connection is opened once.
    """

    def __init__(self) -> None:
        self._open: dict[SshTarget | None, Transport] = {}
        self._lock = threading.Lock()

    def to(self, target: SshTarget | None) -> Transport:
        """The node at `target`; None is this machine."""
        # Imported here: the local-only commands (and the daemon) do not load paramiko.
        from thunderctl.cluster.ssh import SshTransport

        with self._lock:
            if target not in self._open:
                self._open[target] = LocalTransport() if target is None else SshTransport(target)
            return self._open[target]

    def close(self) -> None:
        with self._lock:
            for transport in self._open.values():
                transport.close()
            self._open.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
