"""A synchronous client of the gateway's program and sandbox API, and a program's lifetime as a
context manager: whatever happens inside it, the program is released at the end."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from thunderctl.cluster.state import ClusterNotFound, find_cluster
from thunderctl.cluster.worker_key import read_worker_key
from thunderctl.daemon.client import daemon_answers, fetch_status
from thunderctl.jsonapi import bearer_headers
from thunderctl.profile import load_profile, state_root

# Sandbox preparation can include an image pull; the gateway waits at most this long per call.
READY_WAIT_S = 600.0
# A `wait` pause lasts as long as the longest request in flight; a resume resets every engine's cache.
PAUSE_WAIT_S = 3600.0
# Room above a command's own timeout for the HTTP round trip and the kill of a timed-out command.
EXEC_MARGIN_S = 30.0


class ClusterError(RuntimeError):
    """The gateway refused a call or could not be reached; the message says which call and why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def gateway_url(endpoint: str) -> str:
    """The gateway's root URL from the endpoint as users have it (`thunderctl status` prints the
    OpenAI base URL, ending in /v1)."""
    url = endpoint.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"endpoint {endpoint!r} is not an http(s) URL; give it as `thunderctl status` prints it")
    return url.removesuffix("/v1")


@dataclass(frozen=True)
class Endpoints:
    endpoint: str  # OpenAI-compatible base URL, without /v1
    engines: list[str]  # the vLLM servers behind it: the direct arm and the /metrics source
    api_key: str | None = field(default=None, repr=False)  # the endpoint's
    engine_key: str | None = field(default=None, repr=False)  # the engines'


def cluster_endpoints(name: str | None) -> Endpoints:
    """The running cluster's gateway and its workers in service, from its daemon."""
    state = find_cluster(state_root(), name)
    if not daemon_answers(state):
        raise ClusterNotFound(
            f"cluster {state.cluster!r} is not running (its daemon does not answer); "
            "`thunderctl up` starts it, or give --endpoint URL"
        )
    status = fetch_status(state)
    api_key = load_profile(Path(state.profile_path)).gateway.auth().api_key
    return Endpoints(gateway_url(status.endpoint), status.ready_urls(), api_key, read_worker_key(state.dir))


def new_program_id(name: str) -> str:
    """A program id that names its task and is unique across runs of the same task."""
    return f"{name}-{secrets.token_hex(4)}"


@dataclass
class ClusterClient:
    """The gateway's `/programs` and `/v1/sandboxes` calls; `api_key` is sent as a bearer token
    when the gateway has one configured."""

    endpoint: str
    api_key: str | None = None
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        self.url = gateway_url(self.endpoint)
        # trust_env=False: the gateway is on loopback or a tunnel, never behind the user's proxy.
        self._http = httpx.Client(
            base_url=self.url, headers=bearer_headers(self.api_key), timeout=self.timeout_s, trust_env=False
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(self, method: str, path: str, timeout: float | None = None, **kwargs: Any) -> Any:
        what = f"{method} {self.url}{path}"
        try:
            response = self._http.request(method, path, timeout=timeout or self.timeout_s, **kwargs)
        except httpx.HTTPError as exc:
            raise ClusterError(
                f"{what}: the gateway did not answer ({exc.__class__.__name__}: {exc}); "
                "is the cluster up (`thunderctl status`)?"
            ) from exc
        if response.is_error:
            raise ClusterError(
                f"{what} answered {response.status_code}: {error_message(response)}", response.status_code
            )
        return response.json()

    def served_model(self) -> str:
        """The name the cluster serves its model under (its first model)."""
        models = self._call("GET", "/v1/models")["data"]
        if not models:
            raise ClusterError(f"GET {self.url}/v1/models lists no model; are the cluster's workers ready?")
        return models[0]["id"]

    def program(self, program_id: str) -> dict | None:
        """The gateway's view of a program (`steps`, `tokens`, `phase`...), or None if it does not
        track it (never seen, or released)."""
        for program in self._call("GET", "/programs")["programs"]:
            if program["program_id"] == program_id:
                return program
        return None

    def release_program(self, program_id: str) -> bool:
        """Release the program: its KV reservation and its sandboxes go. Idempotent; True if
        the gateway was tracking it."""
        return self._call("POST", "/programs/release", json={"program_id": program_id})["released"]

    def pause(self, mode: str) -> dict:
        """Pause the cluster for a weight update (POST /admin/pause); a `wait` pause answers once
        the requests in flight have finished."""
        return self._call("POST", "/admin/pause", timeout=PAUSE_WAIT_S, json={"mode": mode})

    def resume(self, weights_changed: bool) -> dict:
        return self._call("POST", "/admin/resume", timeout=PAUSE_WAIT_S, json={"weights_changed": weights_changed})

    def create_sandbox(
        self, program_id: str, image: str | None = None, env: dict[str, str] | None = None, setup: str | None = None
    ) -> dict:
        """Ask for a sandbox of the program; it answers at once while the sandbox is prepared."""
        body = {"program_id": program_id, "image": image, "env": env or None, "setup": setup}
        return self._call("POST", "/v1/sandboxes", json={k: v for k, v in body.items() if v is not None})

    def wait_sandbox_ready(self, sandbox_id: str) -> dict:
        return self._call(
            "GET",
            f"/v1/sandboxes/{sandbox_id}",
            params={"wait": "ready", "timeout": READY_WAIT_S},
            timeout=READY_WAIT_S + EXEC_MARGIN_S,
        )

    def exec(self, sandbox_id: str, cmd: str, timeout_s: float) -> dict:
        """Run a shell command: `{"exit_code", "output", "duration_s", "timed_out", "truncated"}`."""
        return self._call(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/exec",
            json={"cmd": cmd, "timeout": timeout_s},
            timeout=timeout_s + EXEC_MARGIN_S,
        )

    def delete_sandbox(self, sandbox_id: str) -> None:
        """Remove the sandbox now; one already gone (released with its program) is not an error."""
        try:
            self._call("DELETE", f"/v1/sandboxes/{sandbox_id}")
        except ClusterError as exc:
            if exc.status != 404:
                raise


def error_message(response: httpx.Response) -> str:
    """The message of the gateway's error shape `{"error": {"message"}}`, else the body's text."""
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text.strip() or response.reason_phrase


@contextmanager
def released_at_end(client: ClusterClient, program_id: str) -> Iterator[str]:
    """Yield the program id; release the program when the block ends, however it ends (an error,
    Ctrl-C), so the scheduler frees its KV reservation and the pool its sandboxes at once."""
    try:
        yield program_id
    finally:
        client.release_program(program_id)
