"""An SSH tunnel to a worker (`tunnel: true`): a detached local process that forwards a port on
this machine's loopback to the worker's port on its node, for as long as the cluster lives.

It outlives `thunderctl up` (the daemon reaches the worker through it), so it is its own
process: `python -m thunderctl.cluster.tunnel TARGET_JSON LOCAL_PORT REMOTE_PORT`. It exits when
it is told to (SIGTERM) or when its SSH connection drops, so a dead tunnel shows as a dead worker.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from dataclasses import asdict

from thunderctl.cluster.ssh import connect
from thunderctl.cluster.transport import SshTarget

LOCAL_HOST = "127.0.0.1"
LIVENESS_POLL_S = 1.0


def tunnel_command(target: SshTarget, local_port: int, remote_port: int) -> list[str]:
    return [sys.executable, "-m", "thunderctl.cluster.tunnel", json.dumps(asdict(target)), str(local_port), str(remote_port)]


def main(argv: list[str]) -> int:
    target = SshTarget(**json.loads(argv[0]))
    local_port, remote_port = int(argv[1]), int(argv[2])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    connection = connect(target)
    with connection, connection.forward_local(local_port, remote_port, remote_host=LOCAL_HOST, local_host=LOCAL_HOST):
        print(f"forwarding {LOCAL_HOST}:{local_port} to port {remote_port} on {target}", flush=True)
        while not stop.wait(LIVENESS_POLL_S):
            if not connection.is_connected:
                print(f"the SSH connection to {target} dropped", flush=True)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
