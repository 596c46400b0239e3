"""Taking back containers (released, orphaned, adopted, idle) and pulled images (above the disk watermark).

Orphans are containers of the cluster that no live sandbox owns; adopted ones are remembered in the
state file, so a daemon that crashed has the containers of its programs that did not live on
collected at the next start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from thunderctl.docker_labels import LABEL_LEASE
from thunderctl.sandbox.calls import HostCalls
from thunderctl.sandbox.config import SandboxConfig
from thunderctl.sandbox.docker_host import DOCKER_ERRORS
from thunderctl.sandbox.host import SandboxHost
from thunderctl.sandbox.lease import Sandbox, SandboxState
from thunderctl.sandbox.state import PoolState
from thunderctl.sandbox.stats import PoolCounters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sweep:
    """What `down`'s sweep of a cluster's sandbox hosts did."""

    removed: int
    left: list[str]  # what could not be removed, each naming its host and why


class Reclaimer:
    """Works on the pool's own registry of live sandboxes (by lease id), which it shares."""

    def __init__(
        self,
        config: SandboxConfig,
        hosts: Sequence[SandboxHost],
        sandboxes: dict[str, Sandbox],
        calls: HostCalls,
        state: PoolState,
        save_state: Callable[[], None],
        counters: PoolCounters,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.hosts = hosts
        self._sandboxes = sandboxes
        self._calls = calls
        self._state = state
        self._save_state = save_state
        self._counters = counters
        self._clock = clock

    async def discard(self, sandbox: Sandbox) -> None:
        """Mark the sandbox released and remove its container (if a preparation holds it, it will)."""
        sandbox.state = SandboxState.RELEASED
        sandbox.settled.set()
        container = sandbox.container_id or ""
        # A container the pool made is forgotten at once: if it outlives this, the reaper finds
        # it by its labels. An adopted one once it is gone: until then, the state file is the
        # only record of it (it carries no label of ours for the reaper to find).
        if not sandbox.adopted and self._state.forget(container, adopted=False):
            self._save_state()
        if await self.remove_container(sandbox) and sandbox.adopted and self._state.forget(container, adopted=True):
            self._save_state()

    async def remove_container(self, sandbox: Sandbox) -> bool:
        """Whether the sandbox's container is gone (or was never made)."""
        if sandbox.container_id is None:
            return True
        if not sandbox.host.available:
            return False  # the reaper (or the next start, for an adopted one) removes it once the host answers
        try:
            await self._calls.run(sandbox.host.remove, sandbox.container_id)
        except DOCKER_ERRORS as exc:
            log.warning("removing container %s of sandbox %s: %s", sandbox.container_id, sandbox.id, exc)
            return False
        return True

    async def reap(self) -> list[str]:
        """Remove this cluster's sandbox containers that no live sandbox owns; forget dead warm ones.
        Returns what could not be listed or removed (also logged)."""
        failed: list[str] = []
        for host in (h for h in self.hosts if h.available):
            try:
                containers = await self._calls.run(host.sandbox_containers)
            except DOCKER_ERRORS as exc:
                log.warning("listing containers on %s: %s", host.url, exc)
                failed.append(f"the sandboxes on {host.url}: listing them failed: {exc}")
                continue
            by_lease = {c.labels.get(LABEL_LEASE): c for c in containers}
            orphans = [c for lease, c in by_lease.items() if lease not in self._sandboxes]
            reaped = await asyncio.gather(*(self._reap_container(host, c.id) for c in orphans))
            failed += [f"sandbox container {c.id[:12]} on {host.url}" for c, ok in zip(orphans, reaped) if not ok]
            dead_warm = [
                self._sandboxes.pop(sb.id)
                for sb in list(self._sandboxes.values())
                if sb.host is host
                and sb.is_warm
                and sb.state is SandboxState.READY
                and not getattr(by_lease.get(sb.id), "running", False)
            ]
            await asyncio.gather(*(self.discard(sb) for sb in dead_warm))
        return failed

    async def _reap_container(self, host: SandboxHost, container_id: str) -> bool:
        try:
            await self._calls.run(host.remove, container_id)
        except DOCKER_ERRORS as exc:
            log.warning("reaping container %s on %s: %s", container_id, host.url, exc)
            return False
        self._counters.reaped += 1
        return True

    async def collect_previous_adoptions(self) -> None:
        """Containers adopted by programs of a daemon that died that no live sandbox holds: those
        programs are gone."""
        hosts = {h.url: h for h in self.hosts if h.available}
        held = {sb.container_id for sb in self._sandboxes.values()}
        kept = []
        for adopted in self._state.adopted:
            if adopted.container_id in held:
                kept.append(adopted)
                continue
            host = hosts.get(adopted.host)
            if host is None or not await self._reap_container(host, adopted.container_id):
                kept.append(adopted)  # not removed now: tried again at the next start, or `down`
        self._state.adopted = kept
        self._save_state()

    def expire_idle(self) -> list[Sandbox]:
        """Take the sandboxes unused for longer than the idle expiry out of the registry; the
        caller discards them."""
        if self.config.idle_expiry_s is None:
            return []
        cutoff = self._clock() - self.config.idle_expiry_s
        expired = [
            sb
            for sb in self._sandboxes.values()
            if not sb.is_warm and sb.state is not SandboxState.PREPARING and sb.last_used < cutoff
        ]
        for sandbox in expired:
            log.info(
                "sandbox %s of program %s idle for %.0f s: released",
                sandbox.id,
                sandbox.program_id,
                self.config.idle_expiry_s,
            )
            del self._sandboxes[sandbox.id]
        return expired

    async def check_disk(self) -> None:
        """Measure each host's disk use by the pool; above the watermark, evict pulled images."""
        for host in (h for h in self.hosts if h.available):
            pulled = self._state.pulled.get(host.url, {})
            usage = await self._calls.run(host.disk_usage, set(pulled))
            used = usage.containers_bytes + usage.pulled_images_bytes
            # Least recently used first, until back under the watermark.
            for image in sorted(usage.unused_images, key=lambda name: pulled[name]):
                if used <= self.config.disk_high_watermark_bytes:
                    break
                await self._calls.run(host.remove_image, image)
                log.info("evicted image %s from %s: disk above the high watermark", image, host.url)
                del pulled[image]
                used -= usage.unused_images[image]
                self._counters.evicted_images += 1
            self._counters.disk_bytes[host.url] = used
            self._counters.disk_measured_at[host.url] = self._clock()
        self._save_state()
