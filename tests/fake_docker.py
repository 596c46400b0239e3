"""An in-memory Docker engine behind the pool's `SandboxHost` seam, for fast tests of the pool's
logic. It models what the pool relies on: images present or pullable, labelled containers that
run or die, commands with an exit code, output and a duration (past the timeout: killed), disk
use. It runs no process: the real behaviour of each call is what tests/test_sandbox.py checks
on a real dockerd."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from thunderctl.docker_labels import LABEL_CLUSTER, LABEL_LEASE, LABEL_PROGRAM, LABEL_ROLE, ROLE_SANDBOX, is_sandbox
from thunderctl.sandbox.config import SandboxConfig
from thunderctl.sandbox.host import (
    ContainerInfo,
    DiskUsage,
    ExecResult,
    HostUnavailable,
    ImageUnavailable,
    SandboxHost,
)

KILLED_EXIT_CODE = 137  # what the real host reports for a command killed at its timeout


@dataclass
class Command:
    """How a shell command behaves in the fake: what it prints, how it exits, how long it takes."""

    output: str = ""
    exit_code: int = 0
    seconds: float = 0.0


@dataclass
class FakeContainer:
    id: str
    image: str
    labels: dict[str, str]
    running: bool = True
    size_bytes: int = 0  # its writable layer
    created: float = 0.0  # Unix time, on the engine's clock


@dataclass
class ExecCall:
    container_id: str
    command: str  # the shell command, or argv joined by spaces
    env: dict[str, str]
    timeout_s: float


@dataclass
class FakeEngine:
    """One Docker engine's state; outlives the pools (and hosts) that talk to it."""

    images: dict[str, int] = field(default_factory=dict)  # present: name -> size in bytes
    registry: dict[str, int] = field(default_factory=dict)  # pullable when missing: name -> size
    containers: dict[str, FakeContainer] = field(default_factory=dict)
    commands: dict[str, Command] = field(default_factory=dict)  # unknown ones print nothing, exit 0
    answering: bool = True
    clock: Callable[[], float] = time.time  # the host's clock, which stamps a container's creation
    created: list[FakeContainer] = field(default_factory=list)  # in the order they were made
    pulls: list[str] = field(default_factory=list)
    execs: list[ExecCall] = field(default_factory=list)
    # While cleared, `create` waits (in the pool's thread): a test holds preparations in flight.
    creating_allowed: threading.Event = field(default_factory=threading.Event)
    in_create: int = 0
    most_in_create: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.creating_allowed.set()

    def run(self, image: str, labels: dict[str, str], running: bool = True) -> FakeContainer:
        """A container started outside the pool (by an agent, a worker, an older daemon)."""
        container = FakeContainer(secrets.token_hex(32), image, labels, running, created=self.clock())
        self.containers[container.id] = container
        return container

    def exists(self, container_id: str) -> bool:
        return container_id in self.containers

    def lookup(self, reference: str) -> FakeContainer | None:
        """By full id, short id (a prefix of 12+ digits) or name, as Docker resolves them."""
        for container in self.containers.values():
            named = f"thunderctl-{container.labels.get(LABEL_CLUSTER)}-{container.labels.get(LABEL_LEASE)}"
            if reference == named or (len(reference) >= 12 and container.id.startswith(reference)):
                return container
        return None


class FakeHost:
    """A `SandboxHost` over a `FakeEngine`."""

    def __init__(self, engine: FakeEngine, url: str, config: SandboxConfig, cluster: str) -> None:
        self.engine = engine
        self.url = url
        self.config = config
        self.cluster = cluster
        self.available = False
        self.reason: str | None = "not contacted yet"

    def connect(self) -> bool:
        self.available = self.engine.answering
        self.reason = None if self.available else f"no Docker engine answers at {self.url}: connection refused"
        return self.available

    def close(self) -> None:
        self.available = False

    def _engine(self) -> FakeEngine:
        if not self.available or not self.engine.answering:
            raise HostUnavailable(f"Docker host {self.url} is unavailable: {self.reason or 'it stopped answering'}")
        return self.engine

    def ensure_image(self, image: str) -> bool:
        engine = self._engine()
        if image in engine.images:
            return False
        if image not in engine.registry:
            raise ImageUnavailable(f"image {image!r} is not on Docker host {self.url} and could not be pulled")
        engine.images[image] = engine.registry[image]
        engine.pulls.append(image)
        return True

    def create(self, image: str, lease: str, program_id: str | None) -> str:
        engine = self._engine()
        with engine._lock:
            engine.in_create += 1
            engine.most_in_create = max(engine.most_in_create, engine.in_create)
        try:
            engine.creating_allowed.wait()
        finally:
            with engine._lock:
                engine.in_create -= 1
        labels = {
            LABEL_CLUSTER: self.cluster,
            LABEL_ROLE: ROLE_SANDBOX,
            LABEL_PROGRAM: program_id or "",
            LABEL_LEASE: lease,
        }
        container = engine.run(image, labels)
        engine.created.append(container)
        return container.id

    def remove(self, container_id: str) -> None:
        self._engine().containers.pop(container_id, None)

    def inspect(self, container_id: str) -> ContainerInfo | None:
        container = self._engine().lookup(container_id)
        return None if container is None else self._info(container)

    def sandbox_containers(self) -> list[ContainerInfo]:
        containers = self._engine().containers.values()
        return [self._info(c) for c in containers if is_sandbox(c.labels, self.cluster)]

    def disk_usage(self, pulled_images: set[str]) -> DiskUsage:
        engine = self._engine()
        usage = DiskUsage()
        usage.containers_bytes = sum(
            c.size_bytes for c in engine.containers.values() if is_sandbox(c.labels, self.cluster)
        )
        in_use = {c.image for c in engine.containers.values()}
        for image in pulled_images.intersection(engine.images):
            usage.pulled_images_bytes += engine.images[image]
            if image not in in_use:
                usage.unused_images[image] = engine.images[image]
        return usage

    def remove_image(self, image: str) -> None:
        self._engine().images.pop(image, None)

    def exec(self, container_id: str, argv: list[str], env: dict[str, str], timeout_s: float) -> ExecResult:
        engine = self._engine()
        container = engine.containers.get(container_id)
        if container is None or not container.running:
            raise HostUnavailable(f"container {container_id} is not running on {self.url}")
        command = argv[2] if argv[:2] == ["/bin/sh", "-c"] else " ".join(argv)
        engine.execs.append(ExecCall(container_id, command, dict(env), timeout_s))
        behaviour = engine.commands.get(command, Command())
        if behaviour.seconds > timeout_s:
            return ExecResult(KILLED_EXIT_CODE, behaviour.output, timeout_s, timed_out=True)
        return ExecResult(behaviour.exit_code, behaviour.output, behaviour.seconds)

    @staticmethod
    def _info(container: FakeContainer) -> ContainerInfo:
        return ContainerInfo(
            container.id, dict(container.labels), container.running, container.image, container.created
        )


def fake_hosts(engines: dict[str, FakeEngine]) -> Callable[[str, SandboxConfig, str], SandboxHost]:
    """A pool's host factory over these engines, by URL."""

    def make(url: str, config: SandboxConfig, cluster: str) -> SandboxHost:
        return FakeHost(engines[url], url, config, cluster)

    return make
