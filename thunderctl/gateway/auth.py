"""The gateway's API key: one ASGI wrapper in front of every route the gateway serves (the
daemon's sandbox routes included), and the rule that a gateway reachable from the network has one."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from thunderctl.jsonapi import error

API_KEY_ENV = "THUNDERCTL_API_KEY"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"


def env_api_key() -> str | None:
    """The key a gateway started here (`thunderctl serve`) reads from its environment."""
    return os.environ.get(API_KEY_ENV) or None


@dataclass(frozen=True)
class GatewayAuth:
    """Which key the gateway asks for (None: none) and which paths are open without it."""

    api_key: str | None = field(default=None, repr=False)
    metrics_public: bool = False

    @property
    def open_paths(self) -> frozenset[str]:
        return frozenset({HEALTH_PATH, METRICS_PATH} if self.metrics_public else {HEALTH_PATH})


def digest(key: bytes) -> bytes:
    """Keys are compared as hashes: equal lengths, so the time taken tells nothing of the key's length."""
    return hashlib.sha256(key).digest()


class RequireApiKey:
    """Answers 401, shaped as OpenAI does, to any request without `Authorization: Bearer KEY`
    outside the open paths. The key is compared in constant time."""

    def __init__(self, app: ASGIApp, auth: GatewayAuth) -> None:
        self.app = app
        self.auth = auth
        self._expected = digest(auth.api_key.encode()) if auth.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._expected is None or scope["type"] != "http" or scope["path"] in self.auth.open_paths:
            await self.app(scope, receive, send)
            return
        presented = self._presented(scope)
        if presented is not None and hmac.compare_digest(digest(presented), self._expected):
            await self.app(scope, receive, send)
            return
        message = (
            "missing API key: send the header `Authorization: Bearer <key>`"
            if presented is None
            else "incorrect API key provided"
        )
        response = error(401, message, "authentication_error")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    @staticmethod
    def _presented(scope: Scope) -> bytes | None:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return token.strip() if scheme.lower() == b"bearer" else b""
        return None


def is_loopback_host(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def exposure_problem(host: str, auth: GatewayAuth, allow_unauthenticated: bool, fix: str) -> str | None:
    """Why serving on `host` is refused: reachable beyond this machine with no key. `fix`
    says how to set a key where the caller configures it."""
    if auth.api_key or allow_unauthenticated or is_loopback_host(host):
        return None
    return (
        f"the gateway would listen on {host}, beyond loopback, with no API key: anyone who reaches it "
        f"could use the workers and run commands in sandboxes. {fix}"
    )
