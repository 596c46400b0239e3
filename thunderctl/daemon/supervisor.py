"""The daemon's supervisor: the process `up` starts, which holds the gateway's port and keeps a daemon on it.

It binds the gateway's listening socket once and hands it to each daemon it runs, as an inherited
file descriptor (`python -m thunderctl.daemon STATE_DIR FD`): while a daemon that died is started
again, new connections wait in the socket's backlog instead of being refused. A daemon that ends
other than by the shutdown `down` asks for (exit code 0) is started again: at once, then after a
doubling backoff while it keeps dying. Each start and exit is logged in the daemon's log (where
the daemon's own traceback is) and kept in the state directory's DaemonRecord for `status` and `up`.

With `--relays N` (N ≥ 2, the profile's `gateway.relays`) it also runs N relay processes on the
same socket (daemon/relays.py): they accept the clients' connections and the daemon only
schedules. A relay that dies is started again at once (after a doubling backoff while it keeps
dying), whatever the daemon does; the daemon coming and going leaves them running. Its
replacement is a spare relay process started ahead, which has done its imports (a second of CPU,
several seconds on a loaded core) and only has to connect (tens of milliseconds).

The daemon and the relays run in the supervisor's process group, so stopping that group (`down`,
or `up` after a supervisor died) stops them all. It imports no more than the state and the process
helpers: it stays small while the daemon comes and goes.

`python -m thunderctl.daemon.supervisor STATE_DIR HOST PORT BACKLOG [--relays N]`
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
CHILD_POLL_S = 0.1  # how soon a relay that died is noticed


def exit_reason(returncode: int) -> str:
    """A process's end as `status` shows it: its exit code, or the signal that killed it."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


class Spare:
    """A relay process started ahead of need, which waits on stdin for the number it takes."""

    def __init__(self, command: list[str], fd: int) -> None:
        self.command, self.fd = command, fd
        self.process: subprocess.Popen[bytes] | None = None

    def keep_ready(self) -> None:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, pass_fds=(self.fd,))

    def take(self, number: int) -> subprocess.Popen[bytes]:
        """The spare, now relay `number`; the next spare starts at the next `keep_ready`."""
        self.keep_ready()
        process, self.process = self.process, None
        assert process is not None and process.stdin is not None
        try:
            process.stdin.write(f"{number}\n".encode())
            process.stdin.close()
        except BrokenPipeError:
            pass  # it died just now: its relay sees it ended, and starts again, at its next keep_running
        return process


class Child:
    """A relay process the supervisor keeps running: started again at once (from the spare) when
    it dies, after a doubling backoff while it keeps dying."""

    def __init__(self, number: int, spare: Spare) -> None:
        self.number, self.spare, self.name = number, spare, f"relay {number}"
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.streak = 0  # deaths since it last ran well
        self.next_start = 0.0

    def keep_running(self) -> None:
        if self.process is not None and (returncode := self.process.poll()) is not None:
            ran_s = time.monotonic() - self.started
            self.streak = 1 if ran_s >= STABLE_RUN_S else self.streak + 1
            wait_s = backoff_s(self.streak - 1, RESTART_INITIAL_BACKOFF_S, RESTART_MAX_BACKOFF_S)
            self.next_start = time.monotonic() + wait_s
            log.error("%s (pid %d) ended: %s after %.1f s; starting it again in %.0f s",
                      self.name, self.process.pid, exit_reason(returncode), ran_s, wait_s)  # fmt: skip
            self.process = None
        if self.process is None and time.monotonic() >= self.next_start:
            self.process = self.spare.take(self.number)
            self.started = time.monotonic()
            log.info("%s started (pid %d)", self.name, self.process.pid)


class Supervisor:
    def __init__(self, state: ClusterState, listener: socket.socket, relays: int = 1) -> None:
        self.state = state
        self.listener = listener
        self.record = DaemonRecord()
        self.daemon: subprocess.Popen[bytes] | None = None
        self.stopping = False
        fd = listener.fileno()
        self.spare = Spare([sys.executable, "-m", "thunderctl.daemon.relays", str(state.dir), str(fd)], fd)
        # One relay: the daemon relays in its own process, and there is no relay process.
        self.relays = [Child(n, self.spare) for n in range(1, relays + 1)] if relays > 1 else []

    def run(self) -> None:
        """Run daemons until one stops on purpose or the supervisor is asked to stop (SIGTERM, SIGINT)."""
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        try:
            self._run()
        finally:
            self._stop_relays()
            for process in self._relay_processes():
                process.wait()

    def _run(self) -> None:
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
            if poll_until(self._stopped_keeping_relays, wait_s, STOP_POLL_S):
                return
            self.record.restarts += 1

    def _stopped_keeping_relays(self) -> bool:
        if not self.stopping and self.relays:
            for relay in self.relays:
                relay.keep_running()
            self.spare.keep_ready()
        return self.stopping

    def _run_daemon(self) -> int:
        """Start a daemon on the listening socket and wait for it to end (keeping the relays
        running meanwhile); its exit status."""
        fd = self.listener.fileno()
        relays = ["--relays", str(len(self.relays))] if self.relays else []
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "thunderctl.daemon", str(self.state.dir), str(fd), *relays],
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
        if not self.relays:
            return self.daemon.wait()
        while (returncode := self.daemon.poll()) is None:
            self._stopped_keeping_relays()
            time.sleep(CHILD_POLL_S)
        return returncode

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
        self._stop_relays()

    def _relay_processes(self) -> list[subprocess.Popen[bytes]]:
        """The relays' processes and the spare's, if any."""
        return [c.process for c in [*self.relays, self.spare] if c.process is not None]

    def _stop_relays(self) -> None:
        for process in self._relay_processes():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m thunderctl.daemon.supervisor")
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("backlog", type=int)
    parser.add_argument(
        "--relays", type=int, default=1, help="relay processes on the socket (1: none, the daemon relays)"
    )
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
    Supervisor(state, listener, args.relays).run()


if __name__ == "__main__":
    main(sys.argv[1:])
