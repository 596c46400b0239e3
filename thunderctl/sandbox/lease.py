"""A sandbox as the pool tracks it (its lease, state and host) and the errors a lease can end in."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum

from thunderctl.sandbox.docker_host import DOCKER_ERRORS
from thunderctl.sandbox.host import SandboxError, SandboxHost

# What a preparation or a maintenance round may meet: reported, never let out of the pool.
FAILURES: tuple[type[Exception], ...] = (SandboxError, *DOCKER_ERRORS)


class SandboxState(StrEnum):
    PREPARING = "preparing"
    READY = "ready"
    FAILED = "failed"
    RELEASED = "released"


class SandboxNotFound(SandboxError):
    pass


class SandboxFailed(SandboxError):
    pass


class PoolUnavailable(SandboxError):
    pass


class AdoptionRefused(SandboxError):
    """A container the program may not adopt (`sandboxes.adopt`); the message says why."""


@dataclass(eq=False)
class Sandbox:
    id: str  # also the container's `thunderctl.lease` label
    image: str
    host: SandboxHost
    requested_at: float  # on the pool's clock
    last_used: float
    program_id: str | None = None  # None while it waits in the warm pool
    env: dict[str, str] = field(default_factory=dict)  # given to setup and every exec
    pending_setups: list[str] = field(default_factory=list)
    state: SandboxState = SandboxState.PREPARING
    container_id: str | None = None
    error: str | None = None
    adopted: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # ready, failed or released

    @property
    def is_warm(self) -> bool:
        return self.program_id is None

    def view(self) -> dict:
        return {
            "id": self.id,
            "program_id": self.program_id,
            "container_id": self.container_id,
            "host": self.host.url,
            "image": self.image,
            "state": str(self.state),
            "adopted": self.adopted,
            "error": self.error,
        }

    def raise_unless_ready(self) -> None:
        if self.state is SandboxState.RELEASED:
            raise SandboxNotFound(f"sandbox {self.id!r} was released")
        if self.state is SandboxState.FAILED:
            raise SandboxFailed(self.error or f"sandbox {self.id!r} failed")
