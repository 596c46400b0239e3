"""mini-swe-agent exactly as shipped (its DefaultAgent, its litellm model, its LocalEnvironment; no
program id, no extra_body, no release) through `thunderctl serve` in front of a real vLLM-CPU worker.

The tiny model answers gibberish. As in test_agents.py, the config takes the first word of each
answer as the agent's command, so that every step is an LLM call and a command; here the commands
run with an empty PATH, so each is `sh: <word>: not found` (or a harmless shell builtin).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

from support import mini_swe_agent_overrides
from thunderctl.engines.local import LocalEngine, LocalEngineConfig
from thunderctl.processes import pick_free_port

AGENTS = 4
STEPS = 6
# mini-swe-agent's SWE-bench prompt is ~2,500 of the tiny model's tokens: room for four agents at once.
ENGINE = {"block_size": 32, "num_gpu_blocks": 1024, "max_model_len": 8192}


@pytest.fixture(scope="module")
def minisweagent() -> ModuleType:
    """Imported after thunderctl's integration has set litellm's environment (no network at import)."""
    importlib.import_module("thunderctl.integrations.mini_swe_agent")
    return importlib.import_module("minisweagent")


@pytest.fixture(scope="module")
def engine(engine_home, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    config = LocalEngineConfig(port=pick_free_port(), **ENGINE)
    started = LocalEngine.start(engine_home, config, tmp_path_factory.mktemp("engine") / "vllm.log")
    try:
        started.wait_healthy(timeout=480)
        yield started
    finally:
        started.stop()


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("swebench_backticks.yaml", True),
        # Its answers never parse: each is dropped from the history and a correction appended, so each
        # request extends the last request, not request and answer.
        ("mini_textbased.yaml", False),
    ],
)
def test_four_mini_swe_agents_as_shipped_are_four_programs_of_six_steps(
    minisweagent: ModuleType, engine: LocalEngine, start_gateway, tmp_path: Path, spec: str, parsed: bool
) -> None:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_from_spec
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models import get_model
    from minisweagent.utils.serialize import recursive_merge

    gateway = start_gateway([engine.url])
    config = recursive_merge(*(get_config_from_spec(s) for s in [spec, *mini_swe_agent_overrides(STEPS, parsed)]))
    model_config = recursive_merge(
        {"model_class": "litellm_textbased", "cost_tracking": "ignore_errors"},
        config["model"],
        {"model_name": "openai/tiny", "model_kwargs": {"api_base": f"{gateway.url}/v1", "api_key": "-"}},
    )
    agent_config = {k: v for k, v in config["agent"].items() if k != "agent_class"}

    def run(i: int) -> tuple[str, int]:
        agent = DefaultAgent(
            get_model(config=model_config),
            LocalEnvironment(cwd=str(tmp_path), env={"PATH": "/nonexistent"}, timeout=20),
            **agent_config,
        )
        info = agent.run(f"Fix issue number {i} in the repository.")
        return info["exit_status"], agent.n_calls

    with ThreadPoolExecutor(AGENTS) as pool:
        results = list(pool.map(run, range(AGENTS)))

    assert results == [("LimitsExceeded", STEPS)] * AGENTS
    programs = gateway.programs()
    assert sorted(p["steps"] for p in programs.values()) == [STEPS] * AGENTS
    assert all(p["derived"] for p in programs.values())
