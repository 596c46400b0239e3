"""Which workers a profile asks for, and the exact command line each one runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from thunderctl.engines.local import EngineHome, LocalEngineConfig, vllm_server_command, vllm_server_env
from thunderctl.profile import BUILTIN_TINY_MODEL, NodeSpec, Profile

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class WorkerPlan:
    id: str  # "node/replica"
    node: str
    host: str
    port: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the node's environment

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shell_line(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{env} {' '.join(self.command)}".strip()


def gpu_partition(node: NodeSpec, replica: int) -> list[int]:
    """GPUs of one replica: TP8×1 → [0..7]; TP4×2 → [0..3], [4..7]; TP1×8 → [i]."""
    first = replica * node.tensor_parallel
    return list(range(first, first + node.tensor_parallel))


def model_path(profile: Profile, home: EngineHome) -> str:
    return str(home.model_dir) if profile.model.path == BUILTIN_TINY_MODEL else profile.model.path


def cpu_worker(profile: Profile, node: NodeSpec, port: int, home: EngineHome) -> tuple[list[str], dict[str, str]]:
    engine = profile.engine
    config = LocalEngineConfig(
        port=port,
        host=node.host,
        served_model_name=profile.model.served_name,
        num_gpu_blocks=engine.kv_blocks or 256,
        block_size=engine.block_size or 128,
        max_model_len=engine.max_model_len or 16384,
        extra_args=tuple(engine.args),
    )
    python = Path(engine.python) if engine.python else home.python
    command = vllm_server_command(python, Path(model_path(profile, home)), config)
    return command, vllm_server_env(config, {})


def gpu_worker(profile: Profile, node: NodeSpec, replica: int, port: int, home: EngineHome) -> tuple[list[str], dict[str, str]]:
    engine = profile.engine
    command = [
        engine.python or "python3", "-m", VLLM_SERVER_MODULE,
        "--model", model_path(profile, home),
        "--served-model-name", profile.model.served_name,
        "--host", node.host if node.transport == "local" else "0.0.0.0",
        "--port", str(port),
        "--tensor-parallel-size", str(node.tensor_parallel),
        "--enable-prefix-caching",
    ]  # fmt: skip
    if engine.block_size:
        command += ["--block-size", str(engine.block_size)]
    if engine.kv_blocks:
        command += ["--num-gpu-blocks-override", str(engine.kv_blocks)]
    if engine.max_model_len:
        command += ["--max-model-len", str(engine.max_model_len)]
    devices = ",".join(map(str, gpu_partition(node, replica)))
    return [*command, *engine.args], {"CUDA_VISIBLE_DEVICES": devices}


def plan_workers(profile: Profile, home: EngineHome | None = None) -> list[WorkerPlan]:
    home = home or EngineHome.default()
    plans = []
    for node in profile.nodes:
        for replica in range(node.replicas):
            port = node.base_port + replica
            if profile.engine.kind == "vllm-cpu":
                command, env = cpu_worker(profile, node, port, home)
            else:
                command, env = gpu_worker(profile, node, replica, port, home)
            plans.append(WorkerPlan(f"{node.name}/{replica}", node.name, node.host, port, command, env))
    return plans
