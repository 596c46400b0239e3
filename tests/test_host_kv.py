"""A profile's host KV tier as the gateway counts it: GiB to tokens, the command line, and the
capacity the scheduler sees for the worker (a daemon over a fake worker; no GPU needed)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from thunderctl.cluster.host_kv import counted_host_kv_tokens, kv_bytes_per_token
from thunderctl.cluster.plan import plan_workers
from thunderctl.cluster.state import ClusterState, WorkerRecord
from thunderctl.daemon.service import Daemon
from thunderctl.engines.local import EngineHome
from thunderctl.profile import parse_profile

GIB = 2**30
QWEN3_32B = {  # config.json's fields that size the KV (Qwen/Qwen3-32B)
    "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_size": 5120, "torch_dtype": "bfloat16",
}  # fmt: skip
FAKE_GPU_TOKENS = 4096 * 16  # the fake (simulated) worker's KV blocks of 16 tokens, as its /metrics gives them


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("config", "tensor_parallel", "element_bytes", "per_token"),
    [
        (QWEN3_32B, 4, None, 2 * 64 * 8 * 128 * 2),  # the h100-tp4-32b preset's 256 KiB
        (QWEN3_32B, 1, None, 2 * 64 * 8 * 128 * 2),  # the heads only move between GPUs
        (QWEN3_32B, 16, None, 2 * 64 * 1 * 128 * 2 * 16),  # 8 KV heads on 16 GPUs: each holds one
        (QWEN3_32B, 4, 1, 2 * 64 * 8 * 128),  # an FP8 KV cache
        ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "float32"}, 1, None,
         2 * 2 * 4 * 64 * 4),  # no num_key_value_heads or head_dim: multi-head, hidden ÷ heads
        ({"text_config": QWEN3_32B}, 4, None, 2 * 64 * 8 * 128 * 2),  # a multimodal model's decoder
    ],
)  # fmt: skip
def test_kv_bytes_per_token_follow_the_models_config(
    config: dict, tensor_parallel: int, element_bytes: int | None, per_token: int
) -> None:
    assert kv_bytes_per_token(config, tensor_parallel, element_bytes) == per_token


def gpu_profile(tmp_path: Path, url_port: int, **engine: object) -> Path:
    model = tmp_path / "qwen3-32b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_32B))
    profile = {
        "cluster": "gpu",
        "model": {"path": str(model), "served_name": "qwen3-32b"},
        "engine": {"kind": "vllm", "install": "existing", "python": "/usr/bin/python3", **engine},
        "nodes": [{"name": "box", "transport": "local", "gpus": 4, "tensor_parallel": 4, "base_port": url_port}],
        "gateway": {"host": "127.0.0.1", "port": 8300},
        "sandboxes": {"enabled": False},
    }
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


async def scheduler_backend(tmp_path: Path, backend_url: str, **engine: object):
    """The daemon of a profile with one GPU worker (the fake worker), started: the scheduler's worker."""
    profile_path = gpu_profile(tmp_path, 8100, **engine)
    state = ClusterState("gpu", tmp_path / "state", str(profile_path), "http://127.0.0.1:8300/v1")
    state.workers.append(WorkerRecord("box/0", "box", backend_url, 0, "w.log"))
    state.save()
    daemon = Daemon(ClusterState.load(state.dir))
    await daemon.gateway.start()
    try:
        return daemon.gateway.scheduler.workers["box/0"]
    finally:
        await daemon.gateway.stop()


@pytest.mark.anyio
async def test_a_profiles_host_tier_is_counted_as_the_workers_second_level(tmp_path: Path, fake_backend) -> None:
    worker = await scheduler_backend(tmp_path, fake_backend().url, kv_offload_gib=870)
    assert worker.capacity == FAKE_GPU_TOKENS  # the GPU's, as the engine reports it
    assert worker.host_capacity == 870 * GIB // (2 * 64 * 8 * 128 * 2)  # 3,563,520 tokens
    profile = parse_profile(yaml.safe_load(gpu_profile(tmp_path, 8100, kv_offload_gib=870).read_text()), "p.yaml")
    line = plan_workers(profile, EngineHome(Path("/opt/thunderctl")))[0].shell_line()
    assert "--kv-offloading-backend native --kv-offloading-size 870" in line


@pytest.mark.anyio
async def test_the_profile_may_state_the_kv_bytes_per_token(tmp_path: Path, fake_backend) -> None:
    worker = await scheduler_backend(tmp_path, fake_backend().url, kv_offload_gib=10, kv_bytes_per_token=2**20)
    assert worker.host_capacity == 10 * 1024


@pytest.mark.anyio
async def test_without_a_host_tier_the_worker_has_its_gpu_alone(tmp_path: Path, fake_backend) -> None:
    worker = await scheduler_backend(tmp_path, fake_backend().url)
    assert (worker.capacity, worker.host_capacity) == (FAKE_GPU_TOKENS, 0)


def test_a_tier_that_cannot_be_converted_is_not_counted_and_says_what_to_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = yaml.safe_load(gpu_profile(tmp_path, 8100, kv_offload_gib=870).read_text())
    data["model"]["path"] = "Qwen/Qwen3-32B"  # a hub id: no config.json on this machine
    with caplog.at_level(logging.WARNING):
        assert counted_host_kv_tokens(parse_profile(data, "p.yaml"), "box") == 0
    assert "engine.kv_bytes_per_token" in caplog.text
