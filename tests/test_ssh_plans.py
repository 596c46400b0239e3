"""What SSH provisioning decides without a node: GPU layouts and command lines per install mode,
and the parsing of what nodes print (nvidia-smi on an 8×H100 node, ss, ps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from thunderctl.cluster.gpus import (
    RELEASED_FREE_SHARE,
    START_FREE_SHARE,
    GpuQueryError,
    describe,
    parse_gpus,
    short_of_memory,
)
from thunderctl.cluster.install import install_step
from thunderctl.cluster.plan import plan_workers
from thunderctl.cluster.ssh import group_pids, parse_listeners, port_taken
from thunderctl.cluster.state import ClusterState, WorkerRecord
from thunderctl.cluster.transport import SshTarget
from thunderctl.engines.local import EngineHome
from thunderctl.profile import parse_profile

DATA = Path(__file__).with_name("data")
H100_PROFILE = Path(__file__).parents[1] / "profiles" / "2xh100.yaml"
HOME = EngineHome(Path("/opt/thunderctl"))


def recorded(name: str) -> str:
    """A recording without its leading comment line (which says how it was made)."""
    return "".join(line for line in (DATA / name).read_text().splitlines(keepends=True) if not line.startswith("#"))


def h100_profile(**engine: object) -> dict:
    data = yaml.safe_load(H100_PROFILE.read_text())
    data["engine"].update(engine)
    return data


def test_an_idle_8xh100_node_is_read_from_nvidia_smi() -> None:
    gpus = parse_gpus(recorded("nvidia-smi-8xh100.csv"))
    assert [gpu.index for gpu in gpus] == list(range(8))
    assert {(gpu.name, gpu.driver, gpu.total_mib, gpu.free_mib) for gpu in gpus} == {
        ("NVIDIA H100 80GB HBM3", "550.54.15", 81559, 81004)
    }
    assert describe(gpus) == "8 × NVIDIA H100 80GB HBM3, driver 550.54.15, 79.1-79.1 GiB free"
    assert short_of_memory(gpus, list(range(8)), START_FREE_SHARE) == []
    assert short_of_memory(gpus, list(range(8)), RELEASED_FREE_SHARE) == []  # what a clean stop leaves


def test_gpus_a_running_tp4_worker_holds_are_seen_as_busy_and_not_released() -> None:
    gpus = parse_gpus(recorded("nvidia-smi-8xh100-tp4-running.csv"))
    assert [gpu.index for gpu in short_of_memory(gpus, list(range(8)), START_FREE_SHARE)] == [0, 1, 2, 3]
    assert [gpu.index for gpu in short_of_memory(gpus, [0, 1, 2, 3], RELEASED_FREE_SHARE)] == [0, 1, 2, 3]
    assert short_of_memory(gpus, [4, 5, 6, 7], START_FREE_SHARE) == []  # the other half can take a worker
    assert gpus[0].memory_text() == "GPU 0: 7.5 of 79.6 GiB free"


def test_a_gpu_reporting_na_is_an_error_that_says_what_to_do() -> None:
    with pytest.raises(GpuQueryError, match="unexpected nvidia-smi line") as error:
        parse_gpus("0, NVIDIA H100 80GB HBM3, 550.54.15, [N/A], [N/A]\n")
    assert "reset" in error.value.fix


@pytest.mark.parametrize(
    ("replicas", "tp", "devices"),
    [(1, 8, ["0,1,2,3,4,5,6,7"]), (2, 4, ["0,1,2,3", "4,5,6,7"]), (8, 1, [str(i) for i in range(8)])],
)
def test_cuda_visible_devices_partition_the_node_by_tensor_parallel(replicas: int, tp: int, devices: list[str]) -> None:
    data = h100_profile()
    data["nodes"] = [{**data["nodes"][0], "replicas": replicas, "tensor_parallel": tp}]
    plans = plan_workers(parse_profile(data, "p.yaml"), HOME)
    assert [plan.env["CUDA_VISIBLE_DEVICES"] for plan in plans] == devices
    assert all(f"--tensor-parallel-size {tp} " in plan.shell_line() for plan in plans)
    assert [plan.port for plan in plans] == [8100 + i for i in range(replicas)]


def test_pip_install_pins_vllm_in_a_venv_and_workers_run_its_python() -> None:
    profile = parse_profile(h100_profile(install="pip", version="0.11.0"), "p.yaml")
    step = install_step(profile.engine)
    assert step is not None
    assert step.command == (
        "python3 -m venv .cache/thunderctl/vllm-0.11.0 && .cache/thunderctl/vllm-0.11.0/bin/pip "
        "install --disable-pip-version-check vllm==0.11.0"
    )
    assert "grep -qx 'vllm 0.11.0'" in step.done_check
    plan = plan_workers(profile, HOME)[1]
    assert plan.command[:3] == [".cache/thunderctl/vllm-0.11.0/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert plan.ssh == SshTarget("gpu-node-1.example.internal", 22, "ubuntu", "~/.ssh/id_ed25519")
    # A remote node's address may not be its own (NAT): listen on all of them.
    assert "--host 0.0.0.0 --port 8101" in plan.shell_line() and "--enable-prefix-caching" in plan.command


def test_docker_runs_the_official_image_on_its_gpus_labelled_for_cleanup() -> None:
    profile = parse_profile(h100_profile(install="docker", version="0.11.0"), "p.yaml")
    step = install_step(profile.engine)
    assert step is not None and step.command == "docker pull vllm/vllm-openai:v0.11.0"
    plan = plan_workers(profile, HOME)[1]
    assert plan.container == "thunderctl-h100-node-1-1" and plan.env == {}
    assert plan.command[:2] == ["docker", "run"]
    line = plan.shell_line()
    for part in [
        "--rm --name thunderctl-h100-node-1-1",
        "--label thunderctl.cluster=h100",
        "--label thunderctl.role=worker",
        "--label thunderctl.worker=node-1/1",
        """--gpus '"device=4,5,6,7"'""",
        "--ipc=host",
        "-p 0.0.0.0:8101:8101",
        "-v thunderctl-hf-cache:/root/.cache/huggingface",
        "vllm/vllm-openai:v0.11.0 --model Qwen/Qwen3-32B --served-model-name qwen3-32b --host 0.0.0.0 --port 8101",
    ]:
        assert part in line, part


def test_a_host_kv_tier_becomes_vllms_native_offloading_on_gpu_workers() -> None:
    line = plan_workers(parse_profile(h100_profile(kv_offload_gib=870), "p.yaml"), HOME)[0].shell_line()
    assert "--kv-offloading-backend native --kv-offloading-size 870" in line
    assert "--kv-offloading" not in plan_workers(parse_profile(h100_profile(), "p.yaml"), HOME)[0].shell_line()


def test_existing_install_has_nothing_to_install() -> None:
    assert install_step(parse_profile(h100_profile(install="existing"), "p.yaml").engine) is None


def test_a_tunnelled_worker_listens_on_its_nodes_loopback_and_a_loopback_node_on_its_address() -> None:
    data = h100_profile()
    data["nodes"][0] |= {"host": "127.0.0.2", "replicas": 1}
    data["nodes"][1] |= {"tunnel": True, "replicas": 1}
    near, tunnelled = plan_workers(parse_profile(data, "p.yaml"), HOME)
    assert "--host 127.0.0.2" in near.shell_line() and not near.tunnel
    assert "--host 127.0.0.1" in tunnelled.shell_line() and tunnelled.tunnel


def test_the_state_keeps_where_a_worker_runs(tmp_path: Path) -> None:
    target = SshTarget("127.0.0.2", 2222, "root", "/keys/node", jump_host="root@127.0.0.3:2222")
    state = ClusterState("c", tmp_path / "c", "p.yaml", "http://127.0.0.1:8300/v1")
    state.workers.append(
        WorkerRecord(
            "n/0",
            "n",
            "http://127.0.0.1:40000",
            4242,
            ".local/x.log",
            ssh=target,
            gpus=[0, 1],
            container="box",
            tunnel_pid=77,
        )
    )
    state.save()
    assert ClusterState.load(state.dir).workers == state.workers


SS_OUTPUT = """\
LISTEN 0      128        127.0.0.2:2222       0.0.0.0:*
LISTEN 0      4096   127.0.0.53%lo:53         0.0.0.0:*
LISTEN 0      4096         0.0.0.0:9000       0.0.0.0:*
LISTEN 0      511                *:9001             *:*
LISTEN 0      4096            [::]:9002          [::]:*
LISTEN 0      4096           [::1]:9003          [::]:*
"""


@pytest.mark.parametrize(
    ("host", "port", "taken"),
    [
        ("127.0.0.2", 2222, True),
        ("127.0.0.3", 2222, False),
        ("0.0.0.0", 2222, True),
        ("127.0.0.3", 9000, True),
        ("127.0.0.3", 9001, True),
        ("127.0.0.3", 9002, True),
        ("127.0.0.3", 9003, False),
        ("0.0.0.0", 9003, False),
        ("127.0.0.53", 53, True),
        ("127.0.0.2", 8100, False),
    ],
)
def test_a_port_is_taken_on_a_node_as_a_bind_would_find_it(host: str, port: int, taken: bool) -> None:
    assert port_taken(host, port, parse_listeners(SS_OUTPUT)) is taken


def test_a_process_group_on_a_node_is_read_from_ps_without_its_zombies() -> None:
    ps = "    1     1 Ss\n  700   700 Sl\n  701   700 Rl\n  702   700 Z\n  703   703 S\n"
    assert group_pids(ps, 700) == [700, 701]
    assert group_pids(ps, 999) == []
