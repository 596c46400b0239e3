"""Which workers a profile asks for, and the exact command line each one runs."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from thunderctl.cluster.install import container_name, docker_command, venv_python
from thunderctl.cluster.transport import SshTarget
from thunderctl.engines.local import (
    EngineHome,
    LocalEngineConfig,
    vllm_server_command,
    vllm_server_env,
)
from thunderctl.engines.simulated.process import sim_command
from thunderctl.engines.vllm import API_KEY_ENV, DEV_MODE_ENV, STREAM_INTERVAL_FLAG, dev_mode_env, tool_call_args
from thunderctl.gateway.auth import is_loopback_host
from thunderctl.profile import BUILTIN_TINY_MODEL, NodeSpec, Profile

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MASKED_WORKER_KEY = "<worker-key>"  # what --dry-run shows in the key's place


@dataclass(frozen=True)
class WorkerPlan:
    id: str  # "node/replica"
    node: str
    host: str
    port: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the node's environment
    ssh: SshTarget | None = None  # None: this machine
    gpus: tuple[int, ...] = ()
    container: str | None = None  # install: docker; removed after the worker stops
    tunnel: bool = False  # reached through an SSH tunnel from this machine
    keyed: bool = False  # listens beyond loopback: vLLM asks for the cluster's worker key

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def launch_env(self, worker_key: str | None) -> dict[str, str]:
        """The environment it starts with: a keyed worker gets the key there, never in argv."""
        return {**self.env, API_KEY_ENV: worker_key} if self.keyed and worker_key else dict(self.env)

    def shell_line(self) -> str:
        """The command as one could paste it into a shell on the node, the worker key masked."""
        return shlex.join([*(f"{k}={v}" for k, v in self.launch_env(MASKED_WORKER_KEY).items()), *self.command])


def gpu_partition(node: NodeSpec, replica: int) -> list[int]:
    """GPUs of one replica: TP8×1 → [0..7]; TP4×2 → [0..3], [4..7]; TP1×8 → [i]."""
    first = replica * node.tensor_parallel
    return list(range(first, first + node.tensor_parallel))


def ssh_target(node: NodeSpec) -> SshTarget | None:
    if node.transport == "local":
        return None
    return SshTarget(node.host, node.port, node.user, node.key, node.jump_host)


def bind_host(node: NodeSpec) -> str:
    """Where a worker listens on its node."""
    if node.transport == "local":
        return node.host
    if node.tunnel:
        return "127.0.0.1"  # only the tunnel reaches it
    # A loopback node is this machine under another address (the test nodes): stay there.
    # Elsewhere the address we dial may not be the node's own (NAT), so listen on all.
    return node.host if is_loopback_host(node.host) else "0.0.0.0"


def worker_python(profile: Profile, home: EngineHome) -> str | None:
    """The python that runs vllm on the node; None when a container brings its own."""
    engine = profile.engine
    if engine.kind == "vllm-cpu":  # only install: existing (preflight says so)
        return cpu_python(profile, home)
    if engine.install == "docker":
        return None
    return venv_python(engine.version) if engine.install == "pip" else engine.python or "python3"


def cpu_python(profile: Profile, home: EngineHome) -> str:
    return profile.engine.python or str(home.python)


def model_path(profile: Profile, home: EngineHome) -> str:
    return str(home.model_dir) if profile.model.path == BUILTIN_TINY_MODEL else profile.model.path


def engine_args(profile: Profile) -> list[str]:
    """The profile's `vllm serve` arguments after thunderctl's own: the tool-call flags it asks for, its
    stream interval, then engine.args as given (a flag those pass is not added again)."""
    engine = profile.engine
    interval = [] if engine.stream_interval is None else [STREAM_INTERVAL_FLAG, str(engine.stream_interval)]
    return [*tool_call_args(engine.tool_call_parser, engine.args), *interval, *engine.args]


def cpu_worker(profile: Profile, node: NodeSpec, port: int, home: EngineHome) -> tuple[list[str], dict[str, str]]:
    engine = profile.engine
    config = LocalEngineConfig(
        port=port,
        host=bind_host(node),
        served_model_name=profile.model.served_name,
        num_gpu_blocks=engine.kv_blocks or 256,
        block_size=engine.block_size or 128,
        max_model_len=engine.max_model_len or 16384,
        extra_args=tuple(engine_args(profile)),
    )
    command = vllm_server_command(Path(cpu_python(profile, home)), Path(model_path(profile, home)), config)
    return command, vllm_server_env(config, {})


def sim_worker(profile: Profile, node: NodeSpec, port: int) -> list[str]:
    """`thunderctl engine sim` with the profile's shape, in the python that runs thunderctl."""
    engine = profile.engine
    options = ["--served-model-name", profile.model.served_name]
    for flag, value in (
        ("--preset", engine.preset),
        ("--time-scale", engine.time_scale),
        ("--kv-blocks", engine.kv_blocks),
        ("--block-size", engine.block_size),
        ("--max-model-len", engine.max_model_len),
        (STREAM_INTERVAL_FLAG, engine.stream_interval),
    ):
        if value is not None:
            options += [flag, str(value)]
    return sim_command(engine.python or sys.executable, port, bind_host(node), [*options, *engine.args])


def gpu_args(profile: Profile, node: NodeSpec, host: str, port: int, home: EngineHome) -> list[str]:
    engine = profile.engine
    args = [
        "--model", model_path(profile, home),
        "--served-model-name", profile.model.served_name,
        "--host", host,
        "--port", str(port),
        "--tensor-parallel-size", str(node.tensor_parallel),
        "--enable-prefix-caching",
    ]  # fmt: skip
    if engine.block_size:
        args += ["--block-size", str(engine.block_size)]
    if engine.kv_blocks:
        args += ["--num-gpu-blocks-override", str(engine.kv_blocks)]
    if engine.max_model_len:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.kv_offload_gib:
        args += ["--kv-offloading-backend", "native", "--kv-offloading-size", f"{engine.kv_offload_gib:g}"]
    return [*args, *engine_args(profile)]


def gpu_worker(
    profile: Profile, node: NodeSpec, replica: int, port: int, home: EngineHome
) -> tuple[list[str], dict[str, str]]:
    gpus = gpu_partition(node, replica)
    python = worker_python(profile, home)
    if python is None:  # docker: the container sees only its GPUs, and listens on all its addresses
        args = gpu_args(profile, node, "0.0.0.0", port, home)
        worker_id = f"{node.name}/{replica}"
        bind = (bind_host(node), port)
        command = docker_command(
            profile.engine,
            profile.cluster,
            worker_id,
            gpus,
            bind,
            model_path(profile, home),
            args,
            env_from_host=(API_KEY_ENV, DEV_MODE_ENV),
        )
        return command, dev_mode_env(bind[0])
    command = [python, "-m", VLLM_SERVER_MODULE, *gpu_args(profile, node, bind_host(node), port, home)]
    return command, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), **dev_mode_env(bind_host(node))}


def plan_workers(profile: Profile, home: EngineHome | None = None) -> list[WorkerPlan]:
    home = home or EngineHome.default()
    plans = []
    for node in profile.nodes:
        for replica in range(node.replicas):
            port = node.base_port + replica
            worker_id = f"{node.name}/{replica}"
            if profile.engine.kind == "vllm-cpu":
                command, env = cpu_worker(profile, node, port, home)
            elif profile.engine.kind == "sim":
                command, env = sim_worker(profile, node, port), {}
            else:
                command, env = gpu_worker(profile, node, replica, port, home)
            container = container_name(profile.cluster, worker_id) if profile.engine.install == "docker" else None
            gpus = tuple(gpu_partition(node, replica)) if node.gpus else ()
            keyed = not is_loopback_host(bind_host(node))
            plans.append(
                WorkerPlan(
                    worker_id,
                    node.name,
                    node.host,
                    port,
                    command,
                    env,
                    ssh_target(node),
                    gpus,
                    container,
                    node.tunnel,
                    keyed,
                )
            )
    return plans
