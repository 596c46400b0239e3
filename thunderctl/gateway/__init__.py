"""OpenAI-compatible, program-aware gateway in front of vLLM workers."""

from thunderctl.gateway.app import build_app
from thunderctl.gateway.gateway import Gateway, WorkerUnreachable
from thunderctl.gateway.links import WorkerLink
from thunderctl.gateway.server import parse_worker, serve_gateway

__all__ = ["WorkerUnreachable", "Gateway", "WorkerLink", "build_app", "parse_worker", "serve_gateway"]
