"""Sandbox pool configuration: the `sandboxes:` section of a profile."""

from __future__ import annotations

from enum import StrEnum

from docker.utils import parse_bytes
from pydantic import BaseModel, ConfigDict, Field, field_validator

LOCAL_DOCKER = "unix:///var/run/docker.sock"
# Threads for short Docker calls (create, start, remove, list), apart from the exec threads so
# that long-running commands never hold up a release or a new sandbox.
CONTROL_THREADS = 16


class AdoptPolicy(StrEnum):
    """Which containers a program may adopt (`POST /v1/sandboxes/adopt`, `docker_ids` in a request);
    an adopted container is removed with its program."""

    RECENT = "recent"  # created after the program began, and no thunderctl container of another cluster or role
    ANY = "any"  # any container on a sandbox host but this cluster's own workers and sandboxes
    OFF = "off"  # none


class SandboxConfig(BaseModel):
    """What the pool runs, where, and inside which limits."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    image: str = Field(default="busybox:latest", description="image of a sandbox whose request names none")
    warm: int = Field(default=0, ge=0, description="ready containers kept of `image`, handed out at once")
    warm_images: dict[str, int] = Field(default_factory=dict, description="further images to keep warm, image -> count")
    setup: str | None = Field(default=None, description="shell command run in every new container of `image`")
    hosts: list[str] = Field(default_factory=lambda: [LOCAL_DOCKER], min_length=1)
    cpus: float = Field(default=1.0, gt=0)
    memory: str = Field(default="1g", description="memory limit; swap is set equal, so no swap is used")
    pids: int = Field(default=512, gt=0)
    nofile: int = Field(default=4096, gt=0)
    network: str = Field(default="none", description="Docker network mode of sandboxes")
    keepalive: list[str] = Field(
        default_factory=lambda: ["sleep", "infinity"],
        min_length=1,
        description="the container's main process, replacing the image's entrypoint",
    )
    prepare_concurrency: int = Field(default=4, ge=1, description="containers created/set up at once")
    prepare_timeout_s: float = Field(default=300.0, gt=0, description="a longer setup command is killed: failed")
    exec_timeout_s: float = Field(default=600.0, gt=0, description="default and maximum exec timeout")
    exec_output_limit_bytes: int = Field(default=1 << 20, gt=0)
    idle_expiry_s: float | None = Field(default=3600.0, gt=0, description="released when unused this long")
    maintenance_interval_s: float = Field(default=30.0, gt=0, description="reaper, warm check, disk check")
    disk_high_watermark: str = Field(default="20g", description="per host: above it, evict images the pool pulled")
    docker_timeout_s: float = Field(default=60.0, gt=0, description="per Docker API call")
    max_execs: int = Field(default=64, ge=1, description="commands running at once over all sandboxes")
    adopt: AdoptPolicy = Field(
        default=AdoptPolicy.RECENT,
        description=(
            "containers a program may adopt, to be removed with it: `recent` (created after the program's "
            "first request, and not another thunderctl cluster's or a worker), `any` (any container on a "
            "sandbox host but this cluster's own: whoever holds the gateway key can then have a database, "
            "another team's service or another cluster's workers removed), `off` (none)"
        ),
    )

    @field_validator("memory", "disk_high_watermark")
    @classmethod
    def _byte_size(cls, value: str) -> str:
        try:
            parse_bytes(value)
        except Exception as exc:  # docker raises its own DockerException subclasses here
            raise ValueError(f"not a byte size like '512m' or '2g': {value!r}") from exc
        return value

    @field_validator("hosts")
    @classmethod
    def _docker_urls(cls, hosts: list[str]) -> list[str]:
        for url in hosts:
            if not url.startswith(("unix://", "tcp://", "ssh://", "http://", "https://")):
                raise ValueError(f"not a Docker host URL (unix://, tcp://, ssh://): {url!r}")
        return hosts

    @property
    def docker_connections(self) -> int:
        """Connections one host's client keeps: every exec holds one while it runs."""
        return self.max_execs + CONTROL_THREADS

    @property
    def memory_bytes(self) -> int:
        return int(parse_bytes(self.memory))

    @property
    def disk_high_watermark_bytes(self) -> int:
        return int(parse_bytes(self.disk_high_watermark))

    def warm_targets(self) -> dict[str, int]:
        """Image -> number of ready containers the warm pool keeps."""
        targets = {self.image: self.warm} if self.warm else {}
        return targets | {image: n for image, n in self.warm_images.items() if n > 0}
