"""What a cluster started where, on disk, so `down` and a restarted daemon can clean up."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from thunderctl.cluster.transport import SshTarget
from thunderctl.processes import ProcessIdentity


class ClusterNotFound(LookupError):
    pass


@dataclass
class WorkerRecord:
    id: str
    node: str
    url: str  # where the gateway reaches it: the node's address, or a tunnel's local end
    pid: int  # leader of its own process group, on its node
    log_path: str  # on its node
    stopped: bool = False
    ssh: SshTarget | None = None  # the node; None: this machine
    gpus: list[int] = field(default_factory=list)
    container: str | None = None  # install: docker
    tunnel_pid: int | None = None  # the local process holding its SSH tunnel
    # When pid and tunnel_pid started (ProcessIdentity); None in a state from before they were kept.
    start_ticks: int | None = None
    tunnel_start_ticks: int | None = None
    restarts: int = 0  # times a daemon started it again after its process died, across daemon restarts

    @property
    def process(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.start_ticks)

    @property
    def tunnel(self) -> ProcessIdentity | None:
        return ProcessIdentity(self.tunnel_pid, self.tunnel_start_ticks) if self.tunnel_pid else None

    @classmethod
    def from_dict(cls, data: dict) -> WorkerRecord:
        ssh = data.pop("ssh", None)
        return cls(**data, ssh=SshTarget(**ssh) if ssh else None)


@dataclass
class ClusterState:
    cluster: str
    dir: Path
    profile_path: str
    endpoint: str
    created_at: float = field(default_factory=time.time)
    workers: list[WorkerRecord] = field(default_factory=list)
    # The daemon's supervisor (daemon/supervisor.py), leader of the group the daemon runs in.
    supervisor_pid: int | None = None
    supervisor_start_ticks: int | None = None

    @property
    def supervisor_process(self) -> ProcessIdentity | None:
        return ProcessIdentity(self.supervisor_pid, self.supervisor_start_ticks) if self.supervisor_pid else None

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    @property
    def socket_path(self) -> Path:
        return self.dir / "control.sock"

    @property
    def relays_socket_path(self) -> Path:
        """Where relay processes send the daemon's scheduler their messages (gateway/wire.py)."""
        return self.dir / "relays.sock"

    @property
    def gateway_socket_path(self) -> Path:
        """Where relay processes send the routes they do not serve: the daemon's own gateway."""
        return self.dir / "gateway.sock"

    @property
    def daemon_log(self) -> Path:
        """The daemon's output and its supervisor's account of each start and exit."""
        return self.dir / "daemon.log"

    @property
    def daemon_record_file(self) -> Path:
        return self.dir / "daemon.json"

    @property
    def journal_file(self) -> Path:
        """The daemon's programs and what its laws learnt, for the daemon started after it (daemon/journal.py)."""
        return self.dir / "journal.sqlite"

    def worker_log(self, worker_id: str) -> Path:
        return self.dir / "logs" / f"{worker_id.replace('/', '-')}.log"

    def tunnel_log(self, worker_id: str) -> Path:
        return self.dir / "logs" / f"{worker_id.replace('/', '-')}.tunnel.log"

    def worker(self, worker_id: str) -> WorkerRecord:
        for worker in self.workers:
            if worker.id == worker_id:
                return worker
        raise KeyError(worker_id)

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomically(self.state_file, asdict(self) | {"dir": str(self.dir)})

    @classmethod
    def load(cls, directory: Path) -> ClusterState:
        data = json.loads((directory / "state.json").read_text())
        data["dir"] = Path(data["dir"])
        # A state from before the supervisor names the daemon, which led its own group as the supervisor
        # does now: stopping that group stops it.
        if "daemon_pid" in data:
            data["supervisor_pid"] = data.pop("daemon_pid")
            data["supervisor_start_ticks"] = data.pop("daemon_start_ticks", None)
        data["workers"] = [WorkerRecord.from_dict(w) for w in data["workers"]]
        return cls(**data)


@dataclass
class DaemonRecord:
    """The daemon as its supervisor last saw it, in the state directory for `status` and `up` to read;
    the supervisor alone writes it. Times are wall-clock seconds (time.time())."""

    pid: int | None = None
    start_ticks: int | None = None
    started_at: float | None = None
    restarts: int = 0  # times the supervisor started the daemon again after it ended
    last_exit: str | None = None  # "killed by SIGKILL", "exit code 1"
    last_exit_at: float | None = None
    next_start_at: float | None = None  # while the supervisor waits out a backoff before the next start

    @property
    def process(self) -> ProcessIdentity | None:
        return ProcessIdentity(self.pid, self.start_ticks) if self.pid else None

    def save(self, path: Path) -> None:
        write_atomically(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> DaemonRecord:
        """The record, or an empty one where there is none yet (a supervisor that has not started one)."""
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return cls()


def write_atomically(path: Path, data: dict) -> None:
    """As JSON; a crash mid-write leaves the previous file, never half of one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def known_clusters(root: Path) -> list[ClusterState]:
    if not root.is_dir():
        return []
    return [ClusterState.load(d) for d in sorted(root.iterdir()) if (d / "state.json").is_file()]


def find_cluster(root: Path, name: str | None) -> ClusterState:
    """The named cluster, or the only one there is."""
    if name is not None:
        if not (root / name / "state.json").is_file():
            raise ClusterNotFound(f"no cluster named {name!r} under {root}; `thunderctl up` starts one")
        return ClusterState.load(root / name)
    clusters = known_clusters(root)
    if not clusters:
        raise ClusterNotFound(f"no cluster is running (state under {root}); start one with `thunderctl up`")
    if len(clusters) > 1:
        names = ", ".join(c.cluster for c in clusters)
        raise ClusterNotFound(f"several clusters are up ({names}); pick one with -c NAME")
    return clusters[0]
