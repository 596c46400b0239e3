"""Docker's own count of a cluster's sandbox containers and the disk their writable layers use,
per Docker host, apart from the pool's gauges (`bench swe-lite --sandboxes` samples those).

A container counts when it carries the cluster's sandbox labels (`docker_labels.sandbox_selectors`):
whatever else runs on the host — another cluster's sandboxes, its workers, anyone's containers —
is neither counted nor removed. The disk is each container's SizeRw, what `docker system df -v`
lists per container.
"""

from __future__ import annotations

from dataclasses import dataclass

from thunderctl.sandbox.config import SandboxConfig
from thunderctl.sandbox.docker_host import DockerHost
from thunderctl.sandbox.host import HostUnavailable


@dataclass(frozen=True)
class HostCount:
    containers: int
    disk_bytes: int


class SandboxCensus:
    """The cluster's sandboxes on each of `hosts` (Docker URLs, as in the profile's `sandboxes.hosts`)."""

    def __init__(self, cluster: str, hosts: list[str]) -> None:
        self.cluster = cluster
        self._hosts = [DockerHost(url, SandboxConfig(hosts=[url]), cluster) for url in hosts]
        for host in self._hosts:
            if not host.connect():
                raise HostUnavailable(host.reason or f"no Docker engine answers at {host.url}")

    def count(self) -> dict[str, HostCount]:
        counts = {}
        for host in self._hosts:
            listed = host.sandbox_containers(size=True)
            counts[host.url] = HostCount(len(listed), sum(c.disk_bytes or 0 for c in listed))
        return counts

    def remove_all(self) -> int:
        """Remove the cluster's sandboxes still there (after `down`, none should be); how many were."""
        removed = 0
        for host in self._hosts:
            for container in host.sandbox_containers():
                host.remove(container.id)
                removed += 1
        return removed

    def close(self) -> None:
        for host in self._hosts:
            host.close()
