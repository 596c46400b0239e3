"""The sandbox census of `benchmarks/sandbox_leak.py` against a real Docker engine: it counts and
removes the cluster's own sandboxes and nothing else on the host."""

from __future__ import annotations

import secrets

import docker

from thunderctl.bench.sandbox_census import SandboxCensus
from thunderctl.docker_labels import LABEL_CLUSTER, LABEL_ROLE, ROLE_SANDBOX
from thunderctl.sandbox.config import LOCAL_DOCKER, SandboxConfig
from thunderctl.sandbox.docker_host import DockerHost

MIB = 2**20


def test_the_census_counts_and_removes_only_its_clusters_sandboxes(
    docker_client: docker.DockerClient, sandbox_image: str, sandbox_cluster: str
) -> None:
    ours = DockerHost(LOCAL_DOCKER, SandboxConfig(image=sandbox_image), sandbox_cluster)
    assert ours.connect()
    mine = ours.create(sandbox_image, lease=secrets.token_hex(4), program_id="p0")
    ours.exec(mine, ["sh", "-c", f"head -c {MIB} /dev/zero > /workspace"], {}, 30)
    # Another cluster's sandbox on the same engine, with more on its disk than ours.
    foreign = docker_client.containers.run(
        sandbox_image, ["sleep", "600"], detach=True, network_mode="none",
        labels={LABEL_CLUSTER: f"other-{secrets.token_hex(3)}", LABEL_ROLE: ROLE_SANDBOX, "thunderctl.test": "1"},
    )  # fmt: skip
    try:
        foreign.exec_run(["sh", "-c", f"head -c {2 * MIB} /dev/zero > /workspace"])
        census = SandboxCensus(sandbox_cluster, [LOCAL_DOCKER])
        count = census.count()[LOCAL_DOCKER]
        assert count.containers == 1 and MIB <= count.disk_bytes < 2 * MIB
        assert census.remove_all() == 1
        assert census.count()[LOCAL_DOCKER].containers == 0
        foreign.reload()
        assert foreign.status == "running"
        census.close()
    finally:
        ours.close()
        foreign.remove(force=True)
