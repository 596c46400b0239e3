"""Pytest plugin: the agent harnesses that ship as npm packages, Claude Code and Codex CLI, installed
once per session under the engine's home (registered from conftest.py).

`npm install` into the same directory is idempotent: a second session spends a few seconds asking
the registry whether the pinned versions are still what is there.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from support import HarnessClis
from thunderctl.engines.local import EngineHome

# Pinned: the headers and bodies the tests expect are these versions'.
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX_CLI = "@openai/codex@0.171.0"
NPM_INSTALL_TIMEOUT_S = 600.0


@pytest.fixture(scope="session")
def harness_clis(engine_home: EngineHome) -> HarnessClis:
    npm = shutil.which("npm")
    if npm is None:
        # A missing npm is a broken setup, not a reason to skip: fail loudly.
        pytest.fail(
            "npm is not on PATH: the harness tests install Claude Code and Codex CLI with it; "
            "install Node.js 18 or later with npm (apt-get install nodejs npm)",
            pytrace=False,
        )
    prefix = engine_home.root / "clis"
    quiet = ("--save-exact", "--no-audit", "--no-fund")
    command = [npm, "install", "--prefix", str(prefix), *quiet, CLAUDE_CODE, CODEX_CLI]
    installed = subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=NPM_INSTALL_TIMEOUT_S
    )
    if installed.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {installed.returncode}:\n{installed.stderr[-3000:]}", pytrace=False)
    bin_dir = prefix / "node_modules" / ".bin"
    return HarnessClis(claude=bin_dir / "claude", codex=bin_dir / "codex")
