"""What the pool needs of a Docker engine: the `SandboxHost` protocol, its values and its errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from thunderctl.sandbox.config import SandboxConfig


class SandboxError(Exception):
    """A failure a user can act on; the message names the image, host or sandbox."""


class HostUnavailable(SandboxError):
    pass


class ImageUnavailable(SandboxError):
    pass


@dataclass
class ExecResult:
    exit_code: int | None  # None when the command was killed before it reported one
    output: str
    duration_s: float
    timed_out: bool = False
    truncated: bool = False


@dataclass
class ContainerInfo:
    id: str
    labels: dict[str, str]
    running: bool
    image: str
    created: float  # Unix time, on the Docker host's clock
    disk_bytes: int | None = None  # its writable layer (Docker's SizeRw), when asked for: costs Docker a walk


@dataclass
class DiskUsage:
    containers_bytes: int = 0  # writable layers of this cluster's sandboxes
    pulled_images_bytes: int = 0  # images the pool pulled
    unused_images: dict[str, int] = field(default_factory=dict)  # pulled, no container: name -> size


class SandboxHost(Protocol):
    """One Docker engine as the pool drives it. Every method may block: the pool calls them in
    its own threads. Failures are `SandboxError`s, or `docker_host.DOCKER_ERRORS` when the engine
    goes away mid-call. `docker_host.DockerHost` is the real one."""

    url: str
    available: bool
    reason: str | None  # why it is unavailable, for `status`

    def connect(self) -> bool:
        """(Re)check that the engine answers; sets `available` and `reason`."""
        ...

    def close(self) -> None: ...

    def ensure_image(self, image: str) -> bool:
        """Make sure `image` is on the host; True when it had to be pulled."""
        ...

    def create(self, image: str, lease: str, program_id: str | None) -> str:
        """Create and start a sandbox container labelled with the lease; returns its id."""
        ...

    def remove(self, container_id: str) -> None:
        """Kill and remove a container; gone already is fine."""
        ...

    def inspect(self, container_id: str) -> ContainerInfo | None:
        """The container with this id, short id or name; None when there is none."""
        ...

    def sandbox_containers(self) -> list[ContainerInfo]:
        """Every sandbox container of the pool's cluster, running or not (never a worker)."""
        ...

    def disk_usage(self, pulled_images: set[str]) -> DiskUsage: ...

    def remove_image(self, image: str) -> None: ...

    def exec(self, container_id: str, argv: list[str], env: dict[str, str], timeout_s: float) -> ExecResult:
        """Run argv in the container; past timeout_s it is killed and the result says so."""
        ...


# How the pool makes the host of a URL: (url, config, cluster) -> host. `DockerHost` itself is one.
HostFactory = Callable[[str, SandboxConfig, str], SandboxHost]
