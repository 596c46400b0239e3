"""Pytest plugin: simulated vLLM workers (`thunderctl engine sim`) in real processes (registered from conftest.py).

They start in about a second and need no vLLM, so tests that use them are in the fast tier unless
they are marked `slow` for what they do with them (see the marker in pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support import SMALL_SIM
from thunderctl.engines.simulated.process import SimProcess


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., SimProcess]]:
    """Start `thunderctl engine sim` with the given options on a free port; stopped by pid."""
    started: list[SimProcess] = []

    def start(*options: str) -> SimProcess:
        sim = SimProcess(options, tmp_path / f"sim-{len(started)}.log")
        started.append(sim)
        sim.wait_healthy()
        return sim

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture(scope="module")
def small_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    """One SMALL_SIM per test module, for tests that read no counter another test moves (a test that
    reads its own cache hits sends text of its own)."""
    sim = SimProcess(SMALL_SIM, tmp_path_factory.mktemp("small-sim") / "sim.log")
    try:
        sim.wait_healthy()
        yield sim
    finally:
        sim.stop()
