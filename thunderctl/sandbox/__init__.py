"""Docker sandboxes tied to agent programs: a pool over Docker engines and its HTTP routes."""

from thunderctl.sandbox.config import AdoptPolicy, SandboxConfig
from thunderctl.sandbox.host import (
    ExecResult,
    HostUnavailable,
    ImageUnavailable,
    SandboxError,
)
from thunderctl.sandbox.lease import (
    AdoptionRefused,
    PoolUnavailable,
    Sandbox,
    SandboxFailed,
    SandboxNotFound,
    SandboxState,
)
from thunderctl.sandbox.metrics import render_sandbox_metrics
from thunderctl.sandbox.pool import SandboxPool
from thunderctl.sandbox.reclaim import Sweep
from thunderctl.sandbox.routes import sandbox_routes

__all__ = [
    "AdoptPolicy",
    "AdoptionRefused",
    "ExecResult",
    "HostUnavailable",
    "ImageUnavailable",
    "PoolUnavailable",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxFailed",
    "SandboxNotFound",
    "SandboxPool",
    "SandboxState",
    "Sweep",
    "render_sandbox_metrics",
    "sandbox_routes",
]
