"""An SSH tunnel to a worker (`tunnel: true`): a detached local process that forwards a port on
this machine's loopback to the worker's port on its node, for as long as the cluster lives.

It outlives `thunderctl up` (the daemon reaches the worker through it), so it is its own
process: `python -m thunderctl.cluster.tunnel TARGET_JSON LOCAL_PORT REMOTE_PORT`. It exits when
it is told to (SIGTERM) or when its SSH connection drops, so a dead tunnel shows as a dead worker.

fabric's own forward_local is not used: its accept loop dies on the first channel the node
refuses, which is every health probe sent before the worker listens.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import sys
import threading
from dataclasses import asdict

from paramiko import Channel, Transport
from paramiko.ssh_exception import SSHException

from thunderctl.cluster.ssh import connect
from thunderctl.cluster.transport import SshTarget

LOCAL_HOST = "127.0.0.1"
LIVENESS_POLL_S = 1.0
CHUNK = 65536


def tunnel_command(target: SshTarget, local_port: int, remote_port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "thunderctl.cluster.tunnel",
        json.dumps(asdict(target)),
        str(local_port),
        str(remote_port),
    ]


def relay(transport: Transport, client: socket.socket, remote_port: int) -> None:
    """One forwarded connection: a direct-tcpip channel to the worker, bytes both ways until
    either side closes. A refused channel (the worker not listening yet) closes only this one."""
    with client:
        try:
            channel = transport.open_channel("direct-tcpip", (LOCAL_HOST, remote_port), client.getpeername())
        except (SSHException, OSError) as error:
            print(f"port {remote_port} on the node refused a connection: {error}", flush=True)
            return
        with channel:
            pump(client, channel)


def pump(client: socket.socket, channel: Channel) -> None:
    peers: dict[socket.socket | Channel, socket.socket | Channel] = {client: channel, channel: client}
    while True:
        readable, _, _ = select.select(list(peers), [], [])
        for source in readable:
            data = source.recv(CHUNK)
            if not data:
                return
            peers[source].sendall(data)


def main(argv: list[str]) -> int:
    target = SshTarget(**json.loads(argv[0]))
    local_port, remote_port = int(argv[1]), int(argv[2])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with connect(target) as connection, socket.create_server((LOCAL_HOST, local_port)) as listener:
        connection.open()
        listener.settimeout(LIVENESS_POLL_S)
        print(f"forwarding {LOCAL_HOST}:{local_port} to port {remote_port} on {target}", flush=True)
        while not stop.is_set():
            if not connection.is_connected:
                print(f"the SSH connection to {target} dropped", flush=True)
                return 1
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=relay, args=(connection.transport, client, remote_port), daemon=True).start()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
