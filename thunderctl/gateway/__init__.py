"""OpenAI-compatible, program-aware gateway in front of vLLM workers."""

from thunderctl.gateway.app import build_app
from thunderctl.gateway.gateway import BackendUnreachable, Gateway, Upstream
from thunderctl.gateway.server import parse_backend, serve_gateway

__all__ = ["BackendUnreachable", "Gateway", "Upstream", "build_app", "parse_backend", "serve_gateway"]
