"""A program never released ends by itself, through the real daemon: on a cluster of one simulated
worker with real Docker sandboxes, a named program that is never released ends once silent past
the floor (its learnt gaps are shorter), and its sandbox goes with it, as at a release."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import docker
import httpx
import pytest
import yaml

from support import Cli, sim_profile

pytestmark = pytest.mark.docker

MODEL = "qwen3-32b"  # profiles/sim.yaml's served name
FLOOR_S = 6.0
STEPS = 9  # 8 continuation gaps: tool_time_min_samples, so the law is learnt and the floor rules
SLACK_S = 5.0  # ticks (0.5 s) and a loaded machine's lag


def chat(gateway: str, program_id: str, step: int) -> None:
    body = {"model": MODEL, "program_id": program_id, "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"step {step}"}]}  # fmt: skip
    httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60).raise_for_status()


def sandboxes(client: docker.DockerClient, cluster: str) -> list:
    labels = [f"thunderctl.cluster={cluster}", "thunderctl.role=sandbox"]
    return client.containers.list(all=True, sparse=True, filters={"label": labels})


def listed(gateway: str) -> set[str]:
    return {p["program_id"] for p in httpx.get(f"{gateway}/programs", timeout=30).json()["programs"]}


@pytest.fixture
def sim_cluster(tmp_path: Path, module_sandbox_image: str, docker_client: docker.DockerClient):
    name = f"ending-{secrets.token_hex(3)}"
    profile = sim_profile(name, workers=1, time_scale=0.05)
    profile["scheduler"]["tick_interval_s"] = 0.5
    profile["scheduler"]["ending"] = {"floor_s": FLOOR_S}
    profile["sandboxes"] = {"image": module_sandbox_image, "memory": "64m", "pids": 64, "cpus": 0.5}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    cli = Cli(tmp_path / "state")
    cli("up", "-f", str(path))
    try:
        yield f"http://127.0.0.1:{profile['gateway']['port']}", name
    finally:
        cli("down", check=False)
        for container in docker_client.containers.list(all=True, filters={"label": f"thunderctl.cluster={name}"}):
            container.remove(force=True, v=True)


def test_a_named_program_never_released_ends_after_the_floor_and_frees_its_sandbox(
    sim_cluster, docker_client: docker.DockerClient
) -> None:
    gateway, cluster = sim_cluster
    box = httpx.post(f"{gateway}/v1/sandboxes", json={"program_id": "kept"}, timeout=60).json()
    httpx.get(f"{gateway}/v1/sandboxes/{box['id']}", params={"wait": "ready"}, timeout=60).raise_for_status()
    for step in range(STEPS):
        chat(gateway, "kept", step)
        ran = httpx.post(f"{gateway}/v1/sandboxes/{box['id']}/exec", json={"cmd": "true", "timeout": 10}, timeout=30)
        ran.raise_for_status()
    last_answer = time.monotonic()

    time.sleep(FLOOR_S / 2)
    assert "kept" in listed(gateway) and len(sandboxes(docker_client, cluster)) == 1  # silent, not past the floor

    deadline = last_answer + FLOOR_S + SLACK_S
    while ("kept" in listed(gateway) or sandboxes(docker_client, cluster)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert "kept" not in listed(gateway), "the program was not ended within the floor"
    assert time.monotonic() - last_answer >= FLOOR_S
    assert sandboxes(docker_client, cluster) == []
    gone = httpx.post(f"{gateway}/v1/sandboxes/{box['id']}/exec", json={"cmd": "true"}, timeout=30)
    assert gone.status_code == 404
