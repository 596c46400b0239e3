"""What several test modules share: the CLI as a user runs it, profiles, load, polling, /proc
readings. Test modules import from here, never from one another."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import Result
from typer.testing import CliRunner

from thunderctl.bench.closed_loop import LoadSpec, Target, run_load
from thunderctl.bench.results import LoadResult
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.cli import app
from thunderctl.cluster.state import ClusterState
from thunderctl.daemon.status import ClusterStatus
from thunderctl.processes import pick_free_port, pick_free_ports, pid_alive, port_free
from thunderctl.processes.poll import poll_until
from thunderctl.profile import DEFAULT_PROFILE, PROFILES_DIR

# A simulated worker: cpu-tiny with a small cache of 16-token blocks, stepping 100× faster than the model says.
SMALL_SIM_BLOCK = 16
SMALL_SIM = ("--preset", "cpu-tiny", "--kv-blocks", "64", "--block-size", str(SMALL_SIM_BLOCK),
             "--max-model-len", "1024", "--time-scale", "0.01")  # fmt: skip

TCP_LISTEN = "0A"  # the st column of /proc/net/tcp

# The one tool a coding agent offers in the tests' requests, as OpenAI's chat API spells it.
BASH_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]},
        },
    }
]


def mini_swe_agent_overrides(steps: int, parsed: bool = True) -> list[str]:
    """On top of a mini-swe-agent config, for the tiny model: short, deterministic answers, the first
    word of each taken as the command (every answer is a step; not `parsed`: the config's own format,
    which the tiny model's gibberish never meets, so every answer is a format error), and an end
    after `steps` LLM calls."""
    overrides = [
        f"agent.step_limit={steps}",
        "agent.max_consecutive_format_errors=0",
        "model.model_kwargs.max_tokens=12",
        "model.model_kwargs.temperature=0",
    ]
    return [*overrides, r"model.action_regex=\A\W*(\w+)"] if parsed else overrides


SHAPE = AgentShape(
    system_prompt_tokens=200,
    task_tokens=Uniform(100, 200),
    observation_tokens=Uniform(80, 160),
    completion_tokens=Uniform(8, 16),
    steps=Uniform(5, 7),
    tool_seconds=Uniform(0.2, 0.6),
    max_context_tokens=3500,
)


def consecutive_free_ports(count: int) -> int:
    while True:
        base = pick_free_port()
        if base + count < 65000 and all(port_free("127.0.0.1", base + i) for i in range(count)):
            return base


class Cli:
    def __init__(self, state_dir: Path) -> None:
        self.settings = {"THUNDERCTL_STATE_DIR": str(state_dir), "COLUMNS": "200"}
        self.env = os.environ | self.settings

    def in_process(self, *args: str) -> Result:
        """The command in this process (CliRunner), for one that ends before leaving anything running:
        it saves the second or two a fresh interpreter spends importing thunderctl."""
        return CliRunner(env=self.settings).invoke(app, list(args))

    def __call__(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-m", "thunderctl", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"thunderctl {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def status(self) -> ClusterStatus:
        """`thunderctl status --json`, read as the model the daemon answers with. In this process:
        tests poll it, and a fresh interpreter would cost its imports at every look."""
        result = self.in_process("status", "--json")
        if result.exit_code != 0:
            raise AssertionError(f"thunderctl status --json exited {result.exit_code}:\n{result.output}")
        return ClusterStatus.model_validate_json(result.stdout)


@dataclass
class RunningCluster:
    """A cluster a test brought up through the CLI: its CLI, its profile and its state on disk."""

    cli: Cli
    profile: Path
    name: str

    @property
    def state_dir(self) -> Path:
        return Path(self.cli.env["THUNDERCTL_STATE_DIR"]) / self.name

    def state(self) -> ClusterState:
        return ClusterState.load(self.state_dir)


def write_profile(directory: Path, restart: dict | None = None, **changes) -> Path:
    profile = yaml.safe_load(DEFAULT_PROFILE.read_text())
    profile["engine"].update(kv_blocks=128, block_size=32, max_model_len=4064)
    if restart is not None:
        profile["engine"]["restart"] = restart
    profile["scheduler"] = {"tick_interval_s": 0.5, "buffer_tokens": 64}
    for key, value in changes.items():
        profile[key] = value
    path = directory / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def sim_profile(cluster: str, workers: int, **engine: float) -> dict:
    """The shipped profiles/sim.yaml as a cluster of `workers` simulated workers on free ports, one node
    each (no two ports need be adjacent); `engine` overrides its engine settings (time_scale, …)."""
    profile = yaml.safe_load((PROFILES_DIR / "sim.yaml").read_text())
    profile["cluster"] = cluster
    profile["engine"].update(engine)
    profile["nodes"] = [
        {"name": f"sim-{i}", "transport": "local", "replicas": 1, "base_port": port}
        for i, port in enumerate(pick_free_ports(workers))
    ]
    profile["gateway"]["port"] = pick_free_port()
    return profile


def run_load_in_background(endpoint: str, programs: int) -> tuple[threading.Thread, list[LoadResult]]:
    results: list[LoadResult] = []
    spec = LoadSpec(concurrency=4, programs=programs, shape=SHAPE, seed=5)
    gateway_url = endpoint.removesuffix("/v1")

    def work() -> None:
        results.append(asyncio.run(run_load(Target.gateway(gateway_url), spec, [])))

    thread = threading.Thread(target=work)
    thread.start()
    return thread, results


def processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return [pid for pid in found if pid_alive(pid)]


def live_group_members(pgid: int) -> dict[int, str]:
    """pid → command name of the non-zombie processes in a process group, read from /proc.

    Written apart from LocalProcessGroups.group_members on purpose: the test must not trust the code
    it checks.
    """
    members = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat_file.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        state, _ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members[int(stat_file.parent.name)] = name
    return members


def accept_queue(port: int) -> int:
    """How many connections wait to be accepted on the listening socket on 127.0.0.1:`port`:
    its rx_queue in /proc/net/tcp (the kernel's own count; no tool needed)."""
    local = f"0100007F:{port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[3] == TCP_LISTEN:
            return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def connect_unaccepted(port: int, count: int) -> list[socket.socket]:
    """`count` non-blocking connects to 127.0.0.1:`port`, left in whatever state the kernel gets
    them to (queued for accept, or waiting on a SYN a full queue dropped); the caller closes them."""
    sockets = []
    for _ in range(count):
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(("127.0.0.1", port))
        sockets.append(client)
    return sockets


def wait_for(condition: Callable[[], object], timeout: float = 10.0, what: str = "the condition") -> None:
    """Fail the test unless `condition()` holds within `timeout` seconds, looked at every 0.1 s."""
    if not poll_until(condition, timeout):
        pytest.fail(f"timed out after {timeout} s waiting for {what}")


async def eventually(condition: Callable[[], object], timeout: float = 10.0, what: str = "the condition") -> None:
    """wait_for inside a running event loop, which works meanwhile (a pool's preparations and removals)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.002)
