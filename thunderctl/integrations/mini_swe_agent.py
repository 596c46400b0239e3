"""mini-swe-agent on a thunderctl cluster: its Environment in the cluster's sandboxes, its litellm
model with the program id in every request, one released program per agent run.

    from thunderctl.integrations.mini_swe_agent import AgentRunner, AgentTask, load_config
    runner = AgentRunner("http://127.0.0.1:8300/v1", load_config())
    result = runner.run(AgentTask(id="hello", problem_statement="Print hello."))

`run_batch` (and `thunderctl agents run`) runs a list of tasks with a concurrency limit.
"""

from __future__ import annotations

import os
import platform
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Before litellm is imported (mini-swe-agent imports it): litellm otherwise fetches its model
# cost map from the internet at import, and mini-swe-agent prints a banner at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

import litellm  # noqa: E402 - after the environment above, as everything that reaches litellm
from minisweagent import Model  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import get_config_from_spec  # noqa: E402
from minisweagent.exceptions import Submitted, UserInterruption  # noqa: E402
from minisweagent.models import get_model  # noqa: E402
from minisweagent.utils.serialize import recursive_merge  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from thunderctl.integrations.cluster import (  # noqa: E402
    ClusterClient,
    ClusterError,
    gateway_url,
    new_program_id,
    released_at_end,
)
from thunderctl.integrations.tasks import AgentResult, AgentTask  # noqa: E402

# litellm prints a provider list on every price lookup of a model it does not know (any
# cluster's model); the cost is 0 then, which is what cost_tracking="ignore_errors" asks for.
litellm.suppress_debug_info = True

# mini-swe-agent's own SWE-bench configuration for models that answer in text (not tool calls).
DEFAULT_CONFIG = "swebench_backticks.yaml"
# What mini-swe-agent's environments look for on an output's first line to end the run.
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class SandboxEnvironmentConfig(BaseModel):
    """The `environment:` section of a mini-swe-agent config, for a sandbox of the cluster."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(description="the cluster's endpoint, as `thunderctl status` prints it")
    program_id: str = Field(min_length=1, description="the program the sandbox belongs to")
    api_key: str | None = Field(None, exclude=True, repr=False, description="the gateway's key, if it has one")
    image: str | None = Field(None, description="absent: the profile's sandboxes.image")
    cwd: str = Field("", description="directory each command runs in; empty: the image's")
    env: dict[str, str] = Field(default_factory=dict, description="variables of every command")
    timeout: float = Field(60, gt=0, description="seconds a command may run before it is killed")
    interpreter: list[str] = Field(
        default_factory=lambda: ["/bin/sh", "-c"],
        min_length=1,
        description="the command is its last argument, like mini-swe-agent's docker",
    )
    setup: str | None = Field(None, description="shell command run once while the sandbox is prepared")


class ClusterSandboxEnvironment:
    """mini-swe-agent's Environment protocol in a sandbox of the cluster, bound to one program.

    The sandbox is asked for at construction (the cluster prepares it while the agent's first
    LLM call runs), each action is one exec with its timeout, and `cleanup()` removes it; the
    program's release removes it too. A command's exit code, output or timeout is an
    observation for the agent, as in mini-swe-agent's docker environment; a sandbox that
    failed or is gone raises ClusterError, which ends the run.
    """

    def __init__(
        self, *, config_class: type[SandboxEnvironmentConfig] = SandboxEnvironmentConfig, **kwargs: Any
    ) -> None:
        self.config = config_class(**kwargs)
        self.client = ClusterClient(self.config.endpoint, self.config.api_key)
        try:
            sandbox = self.client.create_sandbox(
                self.config.program_id, self.config.image, self.config.env, self.config.setup
            )
        except ClusterError:
            self.client.close()
            raise
        self.sandbox_id: str = sandbox["id"]
        self._ready = sandbox["state"] == "ready"
        self._closed = False

    def execute(self, action: dict, cwd: str = "", *, timeout: float | None = None) -> dict[str, Any]:
        """Run the action's command; returns mini-swe-agent's `{"output", "returncode",
        "exception_info"}` and raises Submitted when the output starts with the submit marker."""
        if self._closed:
            raise ClusterError(f"sandbox {self.sandbox_id} was removed by cleanup(); make a new environment")
        timeout = timeout or self.config.timeout
        self._wait_ready()
        command = self.shell_command(action.get("command", ""), cwd or self.config.cwd)
        result = self.client.exec(self.sandbox_id, command, timeout)
        output: dict[str, Any] = {"output": result["output"], "returncode": result["exit_code"], "exception_info": ""}
        if result["timed_out"]:
            message = f"the command timed out after {timeout:g} s and was killed"
            output |= {
                "returncode": -1,
                "exception_info": message,
                "extra": {"exception_type": "TimeoutError", "exception": message},
            }
        if result["truncated"]:
            output["exception_info"] += " (output truncated by the sandbox's output limit)"
        self._raise_if_submitted(output)
        return output

    def shell_command(self, command: str, cwd: str) -> str:
        """The one shell line the sandbox runs: the interpreter with the command, in `cwd`."""
        line = shlex.join([*self.config.interpreter, command])
        return f"cd {shlex.quote(cwd)} && {line}" if cwd else line

    def _wait_ready(self) -> None:
        if self._ready:
            return
        sandbox = self.client.wait_sandbox_ready(self.sandbox_id)  # a failed preparation is a 422
        if sandbox["state"] != "ready":
            raise ClusterError(f"sandbox {self.sandbox_id} is still {sandbox['state']} after waiting for it")
        self._ready = True

    @staticmethod
    def _raise_if_submitted(output: dict[str, Any]) -> None:
        lines = output["output"].lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )

    def cleanup(self) -> None:
        """Remove the sandbox now (idempotent; one already collected with its program is fine)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.client.delete_sandbox(self.sandbox_id)
        finally:
            self.client.close()

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        # As mini-swe-agent's docker environment: the prompt's system information is this
        # machine's; a container shares its Docker host's kernel, not its distribution.
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        environment = self.config.model_dump(mode="json") | {"sandbox_id": self.sandbox_id}
        kind = f"{self.__class__.__module__}.{self.__class__.__name__}"
        return {"info": {"config": {"environment": environment, "environment_type": kind}}}


def cluster_model(
    endpoint: str, program_id: str, model_name: str, *, api_key: str | None = None, config: dict | None = None
) -> Model:
    """mini-swe-agent's model for `model_name` (litellm's `openai/<served name>`) on the cluster,
    with the program id in every request (`extra_body`). `config` is the `model:` section of a
    mini-swe-agent config; its model_name is replaced, its model_class defaults to the
    text-based litellm model, and costs of a model litellm has no price for count as 0."""
    settings = recursive_merge(
        {"model_class": "litellm_textbased", "cost_tracking": "ignore_errors"},
        config or {},
        {
            "model_name": model_name,
            "model_kwargs": {
                "api_base": f"{gateway_url(endpoint)}/v1",
                "api_key": api_key or "-",  # litellm's OpenAI client needs one; sent as the bearer token
                "extra_body": {"program_id": program_id},
            },
        },
    )
    return get_model(config=settings)


class ClusterAgent(DefaultAgent):
    """mini-swe-agent's DefaultAgent that ends before its next step once `stop` is set."""

    def __init__(self, model: Model, env: ClusterSandboxEnvironment, *, stop: threading.Event, **kwargs: Any) -> None:
        super().__init__(model, env, **kwargs)
        self.stop = stop

    def step(self) -> list[dict]:
        if self.stop.is_set():
            raise UserInterruption(
                {"role": "exit", "content": "Interrupted", "extra": {"exit_status": "Interrupted", "submission": ""}}
            )
        return super().step()


def load_config(specs: list[str] | tuple[str, ...] = ()) -> dict:
    """mini-swe-agent's config from specs as its `-c` takes them: files (its built-in ones by
    name) and `key.path=value` pairs, merged in order. Its `-c` drops the default config once
    given anything, so `-c agent.step_limit=4` alone is a config without prompts that no agent
    can run; here pairs alone go on top of DEFAULT_CONFIG, and only a file replaces it."""
    if all(is_setting(spec) for spec in specs):
        specs = [DEFAULT_CONFIG, *specs]
    return recursive_merge(*(get_config_from_spec(spec) for spec in specs))


def is_setting(spec: str) -> bool:
    """A `key.path=value` spec rather than a file: mini-swe-agent's own test (get_config_from_spec)."""
    return "=" in spec


@dataclass
class AgentRunner:
    """Runs mini-swe-agent tasks on the cluster, each as a program of its own with a sandbox of
    its own, released when the run ends however it ends. Thread-safe: a batch runs one per thread."""

    endpoint: str
    config: dict  # a mini-swe-agent config: its agent, model and environment sections
    model_name: str | None = None  # default: litellm's openai/<the cluster's served model>
    api_key: str | None = None
    output_dir: Path | None = None  # trajectories, as <task id>.traj.json
    stop: threading.Event = field(default_factory=threading.Event)
    _running: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.model_name is None:
            with ClusterClient(self.endpoint, self.api_key) as client:
                self.model_name = f"openai/{client.served_model()}"

    def run(self, task: AgentTask) -> AgentResult:
        program_id = new_program_id(task.id)
        started = time.monotonic()
        agent: ClusterAgent | None = None
        env: ClusterSandboxEnvironment | None = None
        info: dict[str, Any] = {}
        error = ""
        with (
            self._tracked(program_id),
            ClusterClient(self.endpoint, self.api_key) as client,
            released_at_end(client, program_id),
        ):
            try:
                env = ClusterSandboxEnvironment(**self._environment_config(program_id, task))
                model = cluster_model(
                    self.endpoint, program_id, self.model_name, api_key=self.api_key, config=self.config.get("model")
                )
                agent = ClusterAgent(model, env, stop=self.stop, **self._agent_config())
                info = agent.run(task.problem_statement)
            except Exception as exc:  # one agent's failure is its result; the batch goes on
                info, error = {"exit_status": type(exc).__name__, "submission": ""}, str(exc)
            finally:
                if env is not None:
                    env.cleanup()
                tracked = client.program(program_id)
                if agent is not None and self.output_dir is not None:
                    agent.save(self.output_dir / f"{task.id}.traj.json", {"instance_id": task.id})
        return AgentResult(
            task_id=task.id,
            program_id=program_id,
            exit_status=info.get("exit_status", ""),
            submission=info.get("submission", ""),
            steps=agent.n_calls if agent else 0,
            gateway_steps=tracked["steps"] if tracked else 0,
            sandbox_id=env.sandbox_id if env else None,
            duration_s=round(time.monotonic() - started, 3),
            error=error,
        )

    def interrupt(self) -> None:
        """Stop every run at its next step and release the running programs now, so their
        sandboxes go at once; each run still releases its program again when it ends."""
        self.stop.set()
        with self._lock:
            running = sorted(self._running)
        with ClusterClient(self.endpoint, self.api_key) as client:
            for program_id in running:
                client.release_program(program_id)

    @contextmanager
    def _tracked(self, program_id: str) -> Iterator[None]:
        """The program id in the set of running programs (for `interrupt`) while the block runs."""
        with self._lock:
            self._running.add(program_id)
        try:
            yield
        finally:
            with self._lock:
                self._running.discard(program_id)

    def _environment_config(self, program_id: str, task: AgentTask) -> dict:
        section = {k: v for k, v in self.config.get("environment", {}).items() if k != "environment_class"}
        own = {"endpoint": self.endpoint, "program_id": program_id, "api_key": self.api_key}
        return section | own | ({"image": task.image} if task.image else {})

    def _agent_config(self) -> dict:
        return {k: v for k, v in self.config.get("agent", {}).items() if k != "agent_class"}


def run_batch(
    endpoint: str,
    tasks: list[AgentTask],
    *,
    concurrency: int = 4,
    config_specs: list[str] | tuple[str, ...] = (),
    model_name: str | None = None,
    api_key: str | None = None,
    output_dir: Path | None = None,
    on_result: Callable[[AgentResult], None] | None = None,
) -> list[AgentResult]:
    """Run every task as a mini-swe-agent on the cluster, at most `concurrency` at once, and
    return their results in the tasks' order. On Ctrl-C every running agent stops at its next
    step, its program is released at once, tasks not started are dropped, and the
    KeyboardInterrupt is raised again once the running agents have ended."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    runner = AgentRunner(endpoint, load_config(config_specs), model_name, api_key, output_dir)
    results: dict[str, AgentResult] = {}
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="agent") as pool:
        futures = {pool.submit(runner.run, task): task for task in tasks}
        try:
            for future in as_completed(futures):
                result = future.result()
                results[result.task_id] = result
                if on_result is not None:
                    on_result(result)
        except KeyboardInterrupt:
            for future in futures:
                future.cancel()
            runner.interrupt()
            raise
    return [results[task.id] for task in tasks]
