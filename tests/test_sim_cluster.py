"""profiles/sim.yaml end to end: `up`, `status`, `drain`, `logs`, `bench swe-lite --compare` and `down`
through the real CLI, with simulated H100 workers (real processes, real HTTP, the real daemon).

One cluster serves the module, its tests in the order of a cluster's life; the simulated
workers start in a second, so the whole module needs no vLLM, Docker or sshd.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
import yaml

from support import Cli, consecutive_free_ports, processes_mentioning
from thunderctl.processes import pick_free_port, pid_alive
from thunderctl.profile import PROFILES_DIR
from thunderctl.sim.presets import h100_tp4_32b

SIM_PROFILE = PROFILES_DIR / "sim.yaml"
# `up`, a short bench in both arms and `down` take ~20 s on a quiet machine: more than the fast tier's share.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sim_cluster(tmp_path_factory: pytest.TempPathFactory):
    """The shipped profile on free ports under a name of its own, engines ten times faster than real."""
    directory = tmp_path_factory.mktemp("sim-cluster")
    profile = yaml.safe_load(SIM_PROFILE.read_text())
    profile["cluster"] = f"sim-{secrets.token_hex(4)}"
    profile["engine"]["time_scale"] = 0.1
    profile["scheduler"]["tick_interval_s"] = 1
    for node in profile["nodes"]:
        node["base_port"] = consecutive_free_ports(node["replicas"])
    profile["gateway"]["port"] = pick_free_port()
    path = directory / "sim.yaml"
    path.write_text(yaml.safe_dump(profile))
    cli = Cli(directory / "state")
    up = cli("up", "-f", str(path))
    yield cli, up
    cli("down", check=False)


def state_of(cli: Cli, cluster: str) -> dict:
    return json.loads((Path(cli.env["THUNDERCTL_STATE_DIR"]) / cluster / "state.json").read_text())


def test_up_starts_the_simulated_workers_and_status_shows_them(sim_cluster) -> None:
    cli, up = sim_cluster
    status = cli.status()
    assert f"up: 4 worker(s); endpoint {status.endpoint}" in up.stdout
    assert [(w.id, w.state) for w in status.workers] == [
        ("sim-1/0", "ready"),
        ("sim-1/1", "ready"),
        ("sim-2/0", "ready"),
        ("sim-2/1", "ready"),
    ]
    capacity = h100_tp4_32b().engine.kv_capacity_tokens
    assert all(w.kv_capacity_tokens == capacity for w in status.workers)  # read off each worker's /metrics
    table = cli("status").stdout
    assert "sim-2/1" in table and f"{capacity:,}" in table


def test_bench_compare_runs_on_the_simulated_cluster(sim_cluster, tmp_path: Path) -> None:
    cli, _ = sim_cluster
    report_path = tmp_path / "compare.json"
    bench = cli(
        "bench",
        "swe-lite",
        "--compare",
        "--concurrency",
        "4",
        "--duration",
        "8",
        "--warmup",
        "1",
        "--slices",
        "1",
        "--scale",
        "0.1",
        "--time-scale",
        "0.05",
        "--out",
        str(report_path),
    )
    assert "cluster/direct" in bench.stdout
    report = json.loads(report_path.read_text())
    for arm in ("cluster", "direct"):
        figures = report["arms"][arm]
        assert figures["steps_failed"] == 0 and figures["steps_ok"] > 0
        assert figures["hit_rate"] is not None and figures["hit_rate"] > 0  # the history's prefix is cached
    programs = cli.status().scheduler.programs
    assert (programs.reasoning, programs.acting, programs.paused) == (0, 0, 0)


def test_drain_takes_a_node_out_and_undrain_brings_it_back(sim_cluster) -> None:
    cli, _ = sim_cluster
    drained = cli("drain", "sim-2", "--wait", "--timeout", "60")
    assert "drained sim-2/0, sim-2/1" in drained.stdout
    assert [w.state for w in cli.status().workers] == ["ready", "ready", "drained", "drained"]
    cli("undrain", "sim-2")
    assert [w.state for w in cli.status().workers] == ["ready"] * 4


def test_logs_show_what_the_simulated_worker_is(sim_cluster) -> None:
    cli, _ = sim_cluster
    log = cli("logs", "sim-1/0").stdout
    assert "simulated h100-tp4-32b" in log and "serving 'qwen3-32b'" in log


def test_down_leaves_nothing_running(sim_cluster) -> None:
    cli, _ = sim_cluster
    status = cli.status()
    cluster = status.cluster
    state = state_of(cli, cluster)
    pids = [state["supervisor_pid"], status.daemon_pid, *(w["pid"] for w in state["workers"])]
    assert all(pid_alive(pid) for pid in pids)
    down = cli("down")
    assert f"cluster {cluster} is down" in down.stdout
    assert not any(pid_alive(pid) for pid in pids)
    state_dir = Path(cli.env["THUNDERCTL_STATE_DIR"]) / cluster
    assert not state_dir.exists() and processes_mentioning(str(state_dir)) == []
