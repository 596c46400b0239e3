"""One Docker engine, spoken to through the Docker SDK. Every method blocks: the pool runs them
in its own threads so the event loop that relays LLM traffic never waits on Docker."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import cast

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import Ulimit
from docker.utils import parse_repository_tag
from docker.utils.socket import frames_iter
from requests import RequestException

from thunderctl.docker_labels import (
    LABEL_CLUSTER,
    LABEL_LEASE,
    LABEL_PROGRAM,
    LABEL_ROLE,
    ROLE_SANDBOX,
    is_sandbox,
    sandbox_selectors,
)
from thunderctl.sandbox.config import SandboxConfig
from thunderctl.sandbox.host import ContainerInfo, DiskUsage, ExecResult, HostUnavailable, ImageUnavailable

# After a timed-out command is killed, its output stream should close at once; if something
# else still holds it open (a process that left the process group), stop reading after this.
KILL_GRACE_S = 5.0

# The exec'd shell is its own session and process-group leader (runc starts it that way), so
# killing the negative pid kills everything the command started. It reports its pid first, then
# becomes the command with stderr joined to stdout: Docker delivers the two streams through
# separate pipes, so only one stream keeps what the command printed in the order it printed it.
PID_PREAMBLE = 'echo $$; exec "$@" 2>&1'


# What a Docker call can raise besides the SDK's own errors: the transport (requests) failing
# when an engine goes away mid-call, and plain socket errors on exec streams.
DOCKER_ERRORS: tuple[type[Exception], ...] = (DockerException, RequestException, OSError)


class _OutputCollector:
    """Builds one exec's combined output from its frames, taking the pid line off the front."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pid: int | None = None
        self._pid_line = b""
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False

    def add(self, stream: int, data: bytes) -> None:
        if self.pid is None and stream == 1:
            self._pid_line += data
            head, newline, rest = self._pid_line.partition(b"\n")
            if not newline:
                return
            self.pid = int(head)
            data = rest
        room = self.limit - self.size
        if len(data) > room:
            self.truncated = True
            data = data[:room]
        self.chunks.append(data)
        self.size += len(data)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


class DockerHost:
    """The `SandboxHost` of a real Docker engine."""

    def __init__(self, url: str, config: SandboxConfig, cluster: str) -> None:
        self.url = url
        self.config = config
        self.cluster = cluster
        self.available = False
        self.reason: str | None = "not contacted yet"
        self._client: docker.DockerClient | None = None

    @property
    def api(self) -> docker.APIClient:
        client = self._client  # connect() may drop it from another thread
        if client is None or not self.available:
            raise HostUnavailable(f"Docker host {self.url} is unavailable: {self.reason}")
        return client.api

    def connect(self) -> bool:
        """(Re)check that the engine answers; remembers why not, for `status`."""
        try:
            if self._client is None:
                self._client = docker.DockerClient(
                    base_url=self.url,
                    timeout=int(self.config.docker_timeout_s),
                    max_pool_size=self.config.docker_connections,
                    # ssh:// goes through the system ssh client, its config and keys.
                    use_ssh_client=self.url.startswith("ssh://"),
                )
            self._client.api.ping()
        except DOCKER_ERRORS as exc:
            self.close()
            self.available, self.reason = False, f"no Docker engine answers at {self.url}: {exc}"
            return False
        self.available, self.reason = True, None
        return True

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def ensure_image(self, image: str) -> bool:
        """Make sure `image` is on this host; True when it had to be pulled."""
        try:
            self.api.inspect_image(image)
            return False
        except ImageNotFound:
            pass
        repository, tag = parse_repository_tag(image)
        try:
            self.api.pull(repository, tag=tag or "latest")
            self.api.inspect_image(image)
        except DOCKER_ERRORS as exc:
            raise ImageUnavailable(
                f"image {image!r} is not on Docker host {self.url} and could not be pulled: {exc}"
            ) from exc
        return True

    def create(self, image: str, lease: str, program_id: str | None) -> str:
        """Create and start a sandbox container inside the configured limits; returns its id."""
        config = self.config
        host_config = self.api.create_host_config(
            nano_cpus=int(config.cpus * 1e9),
            mem_limit=config.memory_bytes,
            memswap_limit=config.memory_bytes,  # equal to memory: no swap
            pids_limit=config.pids,
            ulimits=[Ulimit(name="nofile", soft=config.nofile, hard=config.nofile)],
            network_mode=config.network,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            init=True,  # a PID 1 that reaps the zombies of commands agents leave behind
        )
        labels = {
            LABEL_CLUSTER: self.cluster,
            LABEL_ROLE: ROLE_SANDBOX,
            LABEL_PROGRAM: program_id or "",
            LABEL_LEASE: lease,
        }
        container = self.api.create_container(
            image,
            entrypoint=config.keepalive,
            labels=labels,
            host_config=host_config,
            name=f"thunderctl-{self.cluster}-{lease}",
        )
        container_id = container["Id"]
        try:
            self.api.start(container_id)
        except DOCKER_ERRORS:
            self.remove(container_id)
            raise
        return container_id

    def remove(self, container_id: str) -> None:
        """Kill and remove a container with its anonymous volumes; gone already is fine."""
        try:
            self.api.remove_container(container_id, v=True, force=True)
        except NotFound:
            pass
        except APIError as exc:
            if exc.status_code != 409 or "already in progress" not in str(exc):
                raise

    def inspect(self, container_id: str) -> ContainerInfo | None:
        try:
            data = self.api.inspect_container(container_id)
        except NotFound:
            return None
        return ContainerInfo(
            id=data["Id"],
            labels=data["Config"].get("Labels") or {},
            running=data["State"]["Running"],
            image=data["Config"]["Image"],
            created=datetime.fromisoformat(data["Created"]).timestamp(),
        )

    def sandbox_containers(self, size: bool = False) -> list[ContainerInfo]:
        """Every sandbox container of this cluster, running or not, as Docker's label filters
        select them: a worker of the same cluster on this engine is never listed. `size`: with
        each one's writable layer, which Docker measures for the listed containers alone."""
        listed = {
            c["Id"]: c
            for selector in sandbox_selectors(self.cluster)
            for c in self.api.containers(all=True, size=size, filters={"label": selector})
        }
        return [
            ContainerInfo(
                id=c["Id"],
                labels=c.get("Labels") or {},
                running=c["State"] == "running",
                image=c["Image"],
                created=float(c["Created"]),
                disk_bytes=c.get("SizeRw", 0) if size else None,
            )
            for c in listed.values()
        ]

    def disk_usage(self, pulled_images: set[str]) -> DiskUsage:
        df = self.api.df()
        usage = DiskUsage()
        for container in df.get("Containers") or []:
            if is_sandbox(container.get("Labels") or {}, self.cluster):
                usage.containers_bytes += container.get("SizeRw") or 0
        for image in df.get("Images") or []:
            names = pulled_images.intersection(image.get("RepoTags") or [])
            if not names:
                continue
            usage.pulled_images_bytes += image["Size"]
            if image.get("Containers", 0) == 0:
                usage.unused_images |= {name: image["Size"] for name in names}
        return usage

    def remove_image(self, image: str) -> None:
        with contextlib.suppress(ImageNotFound):
            self.api.remove_image(image)

    def exec(self, container_id: str, argv: list[str], env: dict[str, str], timeout_s: float) -> ExecResult:
        """Run argv in the container; past timeout_s its whole process group is killed."""
        started = time.monotonic()
        exec_id = self.api.exec_create(
            container_id,
            ["/bin/sh", "-c", PID_PREAMBLE, "thunderctl-exec", *argv],
            environment=env or None,
        )["Id"]
        stream = self.api.exec_start(exec_id, socket=True)
        # The socket itself, under the SocketIO wrapper of a unix or tcp connection.
        raw = cast(socket.socket, getattr(stream, "_sock", stream))
        # Silence is not an error: commands may print nothing for minutes. The timer bounds it.
        raw.settimeout(None)
        collector = _OutputCollector(self.config.exec_output_limit_bytes)
        timed_out = threading.Event()

        def on_timeout() -> None:
            timed_out.set()
            self._kill_group(container_id, collector.pid)
            _daemon_timer(KILL_GRACE_S, self._hang_up, raw).start()

        timer = _daemon_timer(timeout_s, on_timeout)
        timer.start()
        try:
            for stream_id, data in frames_iter(stream, tty=False):
                collector.add(stream_id, data)
        except OSError:
            pass  # the socket was hung up after a kill that did not close it
        finally:
            timer.cancel()
            stream.close()
        exit_code = self.api.exec_inspect(exec_id).get("ExitCode")
        return ExecResult(
            exit_code=exit_code,
            output=collector.text(),
            duration_s=time.monotonic() - started,
            timed_out=timed_out.is_set(),
            truncated=collector.truncated,
        )

    def _kill_group(self, container_id: str, pid: int | None) -> None:
        if pid is None:
            return  # not even started: the hang-up ends the wait
        # `kill` is a shell builtin, so this needs nothing in the image beyond /bin/sh.
        try:
            kill_id = self.api.exec_create(container_id, ["/bin/sh", "-c", f"kill -KILL -{pid} || kill -KILL {pid}"])
            self.api.exec_start(kill_id["Id"])
        except DOCKER_ERRORS:
            pass  # the container is gone, and the command with it

    @staticmethod
    def _hang_up(raw: socket.socket) -> None:
        with contextlib.suppress(OSError):
            raw.shutdown(socket.SHUT_RDWR)


def _daemon_timer(delay_s: float, function: Callable[..., None], *args: object) -> threading.Timer:
    # A pending kill or hang-up must not keep a stopping daemon alive.
    timer = threading.Timer(delay_s, function, args)
    timer.daemon = True
    return timer
