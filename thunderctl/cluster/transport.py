"""How the controller acts on a node: run a command, start and stop a detached process group,
read its log, check ports and disk. lifecycle.py and preflight.py speak only this interface, so
a local node and an SSH node go through one code path.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from thunderctl.processes import (
    GroupStop,
    LocalProcessGroups,
    ProcessIdentity,
    port_free,
    spawn_detached,
    tail_of_file,
)

COMMAND_TIMEOUT_S = 30.0
# `timeout` sends SIGTERM at the limit and SIGKILL this much later, so a hung command on a
# node (an nvidia-smi stuck on a broken GPU) is ended there, not only abandoned by us.
KILL_GRACE_S = 5
# A process that ran out of time under `timeout` exits with this code.
TIMED_OUT_EXIT = 124
LINES_PER_READ = 2000

T = TypeVar("T")
R = TypeVar("R")


class TransportError(RuntimeError):
    """The node cannot be reached, or a command on it did not finish in time."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix


@dataclass(frozen=True)
class SshTarget:
    """Where an SSH node is and how to log in; kept in the cluster state so `down` needs no profile."""

    host: str
    port: int = 22
    user: str | None = None
    key: str | None = None  # a private key file; without one, the agent and ~/.ssh keys
    jump_host: str | None = None  # [user@]host[:port], logged into with the same key

    def __str__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        via = f" via {self.jump_host}" if self.jump_host else ""
        return f"{user}{self.host}:{self.port}{via}"


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def bounded(command: str, timeout: float) -> str:
    """`command` under coreutils' timeout, so it cannot outlive its limit on the node."""
    return f"timeout -k {KILL_GRACE_S} {timeout:g} sh -c {shlex.quote(command)}"


def pid_file_of(log_path: str) -> str:
    """Beside the log: "PID START_TICKS" of the process started with it."""
    return str(Path(log_path).with_suffix(".pid"))


class Transport(ABC):
    """One node. Paths are the node's own; every command has a timeout. As a ProcessGroups it is
    what GroupStop stops a group on."""

    description: str
    poll_s: float

    @abstractmethod
    def run(self, command: str, timeout: float = COMMAND_TIMEOUT_S) -> CommandResult:
        """A shell command; raises TransportError if the node is unreachable or time runs out."""

    @abstractmethod
    def start_detached(self, command: list[str], env: dict[str, str], log_path: str) -> ProcessIdentity:
        """Start `command` in a session of its own (so it leads its process group), output appended
        to log_path and its pid and start time written beside it (.pid); returns those."""

    @abstractmethod
    def start_ticks(self, pid: int) -> int | None:
        """When the process holding `pid` on the node now started (ProcessIdentity's clock), or None."""

    @abstractmethod
    def signal_group(self, pgid: int, sig: signal.Signals) -> bool:
        """Send `sig` to every process of the group; False when there is no such group."""

    @abstractmethod
    def group_members(self, pgid: int) -> list[int]:
        """The live processes of a group (zombies do not count), whoever started it."""

    def pid_reused(self, leader: ProcessIdentity) -> bool:
        """Whether the leader's pid now belongs to another process on the node."""
        return leader.reused(self.start_ticks(leader.pid))

    def group_alive(self, leader: ProcessIdentity) -> bool:
        """Whether any process of the leader's group still runs. Members left by a leader that
        died are its own (the kernel hands out no pid that still names a group); a group led by
        another process that got the pid is not."""
        return not self.pid_reused(leader) and self.group_has_members(leader.pid)

    def group_has_members(self, pgid: int) -> bool:
        """Whether any live process (not a zombie) is in the group."""
        return bool(self.group_members(pgid))

    def stop_group(self, leader: ProcessIdentity, timeout: float) -> bool:
        """GroupStop of the leader's group, `timeout` for SIGTERM; False, with nothing signalled,
        if its pid now belongs to another process (ours had ended long before). Raises StopError
        if something survives SIGKILL."""
        return GroupStop(term_wait_s=timeout).stop_recorded(leader, self)

    @abstractmethod
    def line_count(self, path: str) -> int:
        """Complete lines in a file; 0 if it does not exist (yet)."""

    @abstractmethod
    def lines_from(self, path: str, start: int) -> list[str]:
        """Complete lines from the 0-based line `start` on (at most LINES_PER_READ of them)."""

    @abstractmethod
    def busy_ports(self, host: str, ports: list[int]) -> list[int]:
        """Which of `ports` a server could not bind on `host` right now."""

    @abstractmethod
    def free_gib(self, path: str) -> float:
        """Free disk where `path` is or would be created (its nearest existing parent)."""

    @abstractmethod
    def tail(self, path: str, lines: int) -> str:
        """The last lines of a file, the one still being written included: often the error that
        ended a process."""

    def close(self) -> None:
        """Release the connection, if there is one."""


class LocalTransport(LocalProcessGroups, Transport):
    """This machine: processes and files directly, no shell between."""

    description = "local"

    def run(self, command: str, timeout: float = COMMAND_TIMEOUT_S) -> CommandResult:
        try:
            done = subprocess.run(
                ["sh", "-c", bounded(command, timeout)], check=False, stdin=subprocess.DEVNULL, capture_output=True,
                text=True, timeout=timeout + 2 * KILL_GRACE_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            done = subprocess.CompletedProcess([], TIMED_OUT_EXIT, "", "")
        if done.returncode == TIMED_OUT_EXIT:
            raise TransportError(f"`{command}` did not finish within {timeout:g} s on this machine")
        return CommandResult(done.returncode, done.stdout, done.stderr)

    def start_detached(self, command: list[str], env: dict[str, str], log_path: str) -> ProcessIdentity:
        # Our child until reaped (a zombie at worst), so its start time can still be read.
        process = ProcessIdentity.local(spawn_detached(command, {**os.environ, **env}, Path(log_path)).pid)
        Path(pid_file_of(log_path)).write_text(f"{process.pid} {process.start_ticks}\n")
        return process

    def line_count(self, path: str) -> int:
        try:
            with open(path, "rb") as handle:
                return sum(1 for line in handle if line.endswith(b"\n"))
        except FileNotFoundError:
            return 0

    def lines_from(self, path: str, start: int) -> list[str]:
        try:
            with open(path, errors="replace") as handle:
                lines = [line for i, line in enumerate(handle) if i >= start]
        except FileNotFoundError:
            return []
        complete = lines if not lines or lines[-1].endswith("\n") else lines[:-1]
        return complete[:LINES_PER_READ]

    def tail(self, path: str, lines: int) -> str:
        return tail_of_file(Path(path), lines)

    def busy_ports(self, host: str, ports: list[int]) -> list[int]:
        return [port for port in ports if not port_free(host, port)]

    def free_gib(self, path: str) -> float:
        return free_gib(Path(path))


def free_gib(path: Path) -> float:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / 2**30


def in_parallel(work: Callable[[T], R], items: list[T]) -> list[R]:
    """`work` on every item (node) at once, results in order; the first error is raised once all
    are done, so nothing is still starting behind the caller's back."""
    if len(items) <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(work, items))
