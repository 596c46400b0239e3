"""A node reached over SSH with fabric: key or agent auth, user, port, an optional jump host.

Every command runs under coreutils' `timeout` on the node as well as under fabric's own timeout,
so no provisioning step can hang forever, and a hung command does not linger on the node.
"""

from __future__ import annotations

import shlex
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from fabric import Connection
from invoke.exceptions import CommandTimedOut
from paramiko.ssh_exception import (
    AuthenticationException,
    BadHostKeyException,
    SSHException,
)

from thunderctl.cluster.transport import (
    COMMAND_TIMEOUT_S,
    KILL_GRACE_S,
    LINES_PER_READ,
    TIMED_OUT_EXIT,
    CommandResult,
    SshTarget,
    Transport,
    TransportError,
    bounded,
    pid_file_of,
)
from thunderctl.processes import ProcessIdentity, start_ticks_in

CONNECT_TIMEOUT_S = 10.0
PID_FILE_WAIT_S = 5
# Listeners on these addresses take a port on every IPv4 address of the node.
WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "*", "::"})


def connect(target: SshTarget, timeout: float = CONNECT_TIMEOUT_S) -> Connection:
    """A fabric connection (opened on first use). With a key, only that key is offered, so a
    wrong key fails here rather than succeeding through some other identity in the agent."""
    auth = (
        {"key_filename": str(Path(target.key).expanduser()), "look_for_keys": False, "allow_agent": False}
        if target.key else {}
    )  # fmt: skip
    gateway = Connection(target.jump_host, connect_timeout=timeout, connect_kwargs=auth) if target.jump_host else None
    return Connection(
        target.host, user=target.user, port=target.port, connect_timeout=timeout, connect_kwargs=auth, gateway=gateway
    )


def connection_error(target: SshTarget, error: Exception) -> TransportError:
    """What went wrong logging into a node, and what to do about it."""
    where = f"{target.user}@{target.host}" if target.user else target.host
    if target.key and not Path(target.key).expanduser().is_file():
        return TransportError(f"{target}: no key file {target.key}", "set nodes[].key to an existing private key")
    match error:
        case BadHostKeyException():
            return TransportError(
                f"{target}: the host key differs from the one in known_hosts",
                f"if {target.host} was reinstalled, remove its old entry: ssh-keygen -R {target.host}",
            )
        case AuthenticationException() if target.key:
            return TransportError(
                f"{target}: the key {target.key} was refused",
                f"add {target.key}.pub to ~/.ssh/authorized_keys of {target.user or 'the user'} on "
                f"{target.host} (ssh-copy-id -i {target.key} -p {target.port} {where}), "
                "or correct nodes[].key / nodes[].user",
            )
        case AuthenticationException():
            return TransportError(
                f"{target}: no identity of the agent or ~/.ssh was accepted",
                "set nodes[].key to the node's private key, or add the key to ssh-agent",
            )
        case socket.gaierror():
            return TransportError(f"{target}: cannot resolve {target.host}", "correct nodes[].host")
        case _:
            return TransportError(
                f"{target}: cannot connect ({error})",
                "check nodes[].host and nodes[].port, that sshd runs on the node, and "
                "nodes[].jump_host if it is only reachable through one",
            )


class SshTransport(Transport):
    poll_s = 0.5  # each look at a group is a round trip

    def __init__(self, target: SshTarget, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.target = target
        self.description = target.host
        self._connection = connect(target, connect_timeout)

    def run(self, command: str, timeout: float = COMMAND_TIMEOUT_S) -> CommandResult:
        try:
            result = self._connection.run(
                bounded(command, timeout), hide=True, warn=True, in_stream=False, timeout=timeout + 2 * KILL_GRACE_S
            )
        except CommandTimedOut:
            result = None
        except (SSHException, OSError, EOFError) as error:
            raise connection_error(self.target, error) from None
        if result is None or result.exited == TIMED_OUT_EXIT:
            raise TransportError(f"`{command}` did not finish within {timeout:g} s on {self.target.host}")
        return CommandResult(result.exited, result.stdout, result.stderr)

    def start_detached(self, command: list[str], env: dict[str, str], log_path: str) -> ProcessIdentity:
        pid_path = pid_file_of(log_path)
        # The inner shell writes its own pid and start time after setsid, so the file holds the
        # group leader whether or not setsid had to fork; exec keeps both for the command itself.
        # Its command name is "sh" (no spaces) while it writes, so cut finds field 22 (starttime).
        leader = shlex.join(
            [
                "env",
                *(f"{k}={v}" for k, v in env.items()),
                "setsid",
                "sh",
                "-c",
                'echo $$ $(cut -d " " -f 22 /proc/$$/stat) > "$0" && exec "$@"',
                pid_path,
                *command,
            ]
        )
        log, pid = shlex.quote(log_path), shlex.quote(pid_path)
        script = (
            f"mkdir -p {shlex.quote(str(Path(log_path).parent))} && rm -f {pid} && "
            f"{{ {leader} >> {log} 2>&1 < /dev/null & }}\n"
            f"for _ in $(seq {PID_FILE_WAIT_S * 10}); do [ -s {pid} ] && exec cat {pid}; sleep 0.1; done; exit 1"
        )
        result = self.run(script)
        if not result.ok:
            raise TransportError(f"could not start {command[0]} on {self.target.host}:\n{self.tail(log_path, 20)}")
        pid, start_ticks = map(int, result.stdout.split())
        return ProcessIdentity(pid, start_ticks)

    def start_ticks(self, pid: int) -> int | None:
        result = self.run(f"cat /proc/{pid}/stat")
        return start_ticks_in(result.stdout) if result.ok else None

    def group_members(self, pgid: int) -> list[int]:
        return group_pids(self._tool("ps -e -o pid=,pgid=,stat=", "procps"), pgid)

    def _tool(self, command: str, package: str) -> str:
        """The output of a standard tool; an empty answer from a missing tool would read as
        "nothing runs" or "no port is taken", so its absence is an error."""
        result = self.run(command)
        if not result.ok:
            raise TransportError(
                f"`{command}` failed on {self.target.host}: {result.stderr.strip()}", f"install {package} on the node"
            )
        return result.stdout

    def signal_group(self, pgid: int, sig: signal.Signals) -> bool:
        # `kill -SIG -PGID` signals the group; dash's kill knows no `--`. A kill that fails
        # while members remain (not ours to signal) is no proof that the group has ended.
        return self.run(f"kill -{sig.name.removeprefix('SIG')} -{pgid}").ok or bool(self.group_members(pgid))

    def line_count(self, path: str) -> int:
        result = self.run(f"wc -l < {shlex.quote(path)}")
        return int(result.stdout) if result.ok else 0

    def lines_from(self, path: str, start: int) -> list[str]:
        result = self.run(f"tail -n +{start + 1} {shlex.quote(path)} | head -n {LINES_PER_READ}")
        lines = result.stdout.splitlines(keepends=True)
        return lines if not lines or lines[-1].endswith("\n") else lines[:-1]

    def tail(self, path: str, lines: int) -> str:
        result = self.run(f"tail -n {lines} {shlex.quote(path)}")
        return result.stdout if result.ok else f"(no log at {self.target.host}:{path})\n"

    def busy_ports(self, host: str, ports: list[int]) -> list[int]:
        listeners = parse_listeners(self._tool("ss -Hltn", "iproute2"))
        return [port for port in ports if port_taken(host, port, listeners)]

    def free_gib(self, path: str) -> float:
        # df needs an existing path: walk up to the nearest parent that exists.
        script = f'p={shlex.quote(path)}; while [ ! -e "$p" ]; do p=$(dirname "$p"); done; df -Pk "$p" | tail -n 1'
        return int(self._tool(script, "coreutils").split()[3]) / 2**20

    def close(self) -> None:
        self._connection.close()


def group_pids(ps_output: str, pgid: int) -> list[int]:
    """Live members of a process group in `ps -e -o pid=,pgid=,stat=`; a zombie holds nothing."""
    members = []
    for line in ps_output.splitlines():
        pid, group, stat = line.split()[:3]
        if int(group) == pgid and not stat.startswith("Z"):
            members.append(int(pid))
    return members


@dataclass(frozen=True)
class Listener:
    address: str
    port: int


def parse_listeners(ss_output: str) -> list[Listener]:
    """The listening TCP sockets in `ss -Hltn` (state, recv-q, send-q, local address:port, peer)."""
    listeners = []
    for line in ss_output.splitlines():
        local = line.split()[3]
        address, port = local.rsplit(":", 1)
        # [::]:22 and 127.0.0.53%lo:53 → :: and 127.0.0.53
        listeners.append(Listener(address.strip("[]").split("%")[0], int(port)))
    return listeners


def port_taken(host: str, port: int, listeners: list[Listener]) -> bool:
    """Whether binding host:port (an IPv4 address) would fail with these listeners."""

    def blocks(listener: Listener) -> bool:
        if listener.address in WILDCARD_ADDRESSES or listener.address == host:
            return True
        # Binding every IPv4 address collides with any IPv4 listener; an IPv6-only one is apart.
        return host == "0.0.0.0" and ":" not in listener.address

    return any(listener.port == port and blocks(listener) for listener in listeners)
