"""The daemon's supervisor: the process `up` starts, which holds the gateway's port and keeps a daemon on it.

It binds the gateway's listening socket once and hands it to each daemon it runs, as an inherited
file descriptor (`python -m thunderctl.daemon STATE_DIR FD`): while a daemon that died is started
again, new connections wait in the socket's backlog instead of being refused. A daemon that ends
other than by the shutdown `down` asks for (exit code 0) is started again: at once, then after a
doubling backoff while it keeps dying. Each start and exit is logged in the daemon's log (where
the daemon's own traceback is) and kept in the state directory's DaemonRecord for `status` and `up`.

The daemon runs in the supervisor's process group, so stopping that group (`down`, or `up` after a
supervisor died) stops both. It imports no more than the state and the process helpers: it stays
small while the daemon comes and goes.

`python -m thunderctl.daemon.supervisor STATE_DIR HOST PORT BACKLOG`
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from thunderctl.cluster.state import ClusterState, DaemonRecord
from thunderctl.processes import ProcessIdentity, backoff_s, listening_socket, poll_until

log = logging.getLogger("thunderctl.daemon.supervisor")  # not __main__, as `python -m` would name it

RESTART_INITIAL_BACKOFF_S = 1.0  # the wait before a second restart in a row; it doubles after each
RESTART_MAX_BACKOFF_S = 30.0
# A daemon that stayed up this long ran well: if it dies now, it is started again at once.
STABLE_RUN_S = 60.0
STOP_POLL_S = 0.1  # how soon a backoff notices a stop


def exit_reason(returncode: int) -> str:
    """A process's end as `status` shows it: its exit code, or the signal that killed it."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


class Supervisor:
    def __init__(self, state: ClusterState, listener: socket.socket) -> None:
        self.state = state
        self.listener = listener
        self.record = DaemonRecord()
        self.daemon: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def run(self) -> None:
        """Run daemons until one stops on purpose or the supervisor is asked to stop (SIGTERM, SIGINT)."""
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        streak = 0  # deaths since the daemon last ran well, the latest included
        while True:
            started = time.monotonic()
            returncode = self._run_daemon()
            ran_s = time.monotonic() - started
            if self.stopping or returncode == 0:
                log.info("daemon ended (%s after %.1f s); its supervisor stops", exit_reason(returncode), ran_s)
                return
            streak = 1 if ran_s >= STABLE_RUN_S else streak + 1
            wait_s = backoff_s(streak - 1, RESTART_INITIAL_BACKOFF_S, RESTART_MAX_BACKOFF_S)
            self._ended(exit_reason(returncode), ran_s, wait_s)
            if poll_until(lambda: self.stopping, wait_s, STOP_POLL_S):
                return
            self.record.restarts += 1

    def _run_daemon(self) -> int:
        """Start a daemon on the listening socket and wait for it to end; its exit status."""
        fd = self.listener.fileno()
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "thunderctl.daemon", str(self.state.dir), str(fd)],
            stdin=subprocess.DEVNULL,
            pass_fds=(fd,),  # its output goes where the supervisor's does: the daemon's log
        )
        if self.stopping:  # asked to stop while it was being started: it never saw the signal
            self.daemon.terminate()
        daemon = ProcessIdentity.local(self.daemon.pid)
        self.record.pid, self.record.start_ticks = daemon.pid, daemon.start_ticks
        self.record.started_at, self.record.next_start_at = time.time(), None
        self.record.save(self.state.daemon_record_file)
        log.info("daemon started (pid %d, restart %d)", daemon.pid, self.record.restarts)
        return self.daemon.wait()

    def _ended(self, reason: str, ran_s: float, wait_s: float) -> None:
        now = time.time()
        self.record.last_exit, self.record.last_exit_at = reason, now
        self.record.next_start_at = now + wait_s
        self.record.save(self.state.daemon_record_file)
        again = "now" if wait_s == 0 else f"in {wait_s:.0f} s (it keeps dying)"
        log.error(
            "daemon (pid %s) ended: %s after %.1f s; starting it again %s",
            self.record.pid,
            reason,
            ran_s,
            again,
        )

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)  # a graceful end: it lets its requests finish


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m thunderctl.daemon.supervisor")
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("backlog", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = ClusterState.load(args.state_dir)
    try:
        listener = listening_socket(args.host, args.port, args.backlog)
    except OSError as exc:
        sys.exit(
            f"the gateway cannot listen on {args.host}:{args.port}: {exc.strerror}; free it or change gateway.port"
        )
    log.info("supervising the daemon of cluster %s on %s:%d", state.cluster, args.host, args.port)
    Supervisor(state, listener).run()


if __name__ == "__main__":
    main(sys.argv[1:])
