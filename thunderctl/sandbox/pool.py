"""The sandbox pool: per-program Docker sandboxes over one or more engines, prepared in the
background in the scheduler's resume order, kept warm per image, and reclaimed the moment their
program ends. It knows programs only by id: the daemon calls it on lifecycle events."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from string import hexdigits
from typing import TypeVar

from thunderctl.docker_labels import LABEL_CLUSTER, LABEL_LEASE
from thunderctl.sandbox.config import CONTROL_THREADS, SandboxConfig
from thunderctl.sandbox.docker_host import (
    DOCKER_ERRORS,
    ContainerInfo,
    DockerHost,
    ExecResult,
    SandboxError,
)
from thunderctl.sandbox.state import AdoptedContainer, PoolState

log = logging.getLogger(__name__)

# What a preparation or a maintenance round may meet: reported, never let out of the pool.
FAILURES: tuple[type[Exception], ...] = (SandboxError, *DOCKER_ERRORS)

T = TypeVar("T")

LATENCY_WINDOW = 1000  # latest preparations kept for percentiles
SHORT_ID_LENGTH = 12  # digits of a container id that `docker ps` shows
SETUP_OUTPUT_TAIL = 2000  # characters of a failed setup's output quoted in its error


class SandboxState(StrEnum):
    PREPARING = "preparing"
    READY = "ready"
    FAILED = "failed"
    RELEASED = "released"


class SandboxNotFound(SandboxError):
    pass


class SandboxFailed(SandboxError):
    pass


class PoolUnavailable(SandboxError):
    pass


@dataclass(eq=False)
class Sandbox:
    id: str  # also the container's `thunderctl.lease` label
    image: str
    host: DockerHost
    program_id: str | None = None  # None while it waits in the warm pool
    env: dict[str, str] = field(default_factory=dict)  # given to setup and every exec
    pending_setups: list[str] = field(default_factory=list)
    state: SandboxState = SandboxState.PREPARING
    container_id: str | None = None
    error: str | None = None
    adopted: bool = False
    requested_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # ready, failed or released

    @property
    def is_warm(self) -> bool:
        return self.program_id is None

    def view(self) -> dict:
        return {
            "id": self.id,
            "program_id": self.program_id,
            "container_id": self.container_id,
            "host": self.host.url,
            "image": self.image,
            "state": str(self.state),
            "adopted": self.adopted,
            "error": self.error,
        }


def percentiles(values: Iterable[float]) -> dict[str, float | int | None]:
    """Nearest-rank p50/p90/p99 of the values."""
    ordered = sorted(values)
    if not ordered:
        return {"count": 0, "p50": None, "p90": None, "p99": None}

    def rank(q: int) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, -(-q * len(ordered) // 100) - 1))], 4)

    return {"count": len(ordered), "p50": rank(50), "p90": rank(90), "p99": rank(99)}


class SandboxPool:
    def __init__(self, config: SandboxConfig, cluster: str, state_path: Path | None = None) -> None:
        self.config = config
        self.cluster = cluster
        self.state_path = state_path
        self.hosts = [DockerHost(url, config, cluster) for url in config.hosts]
        self._sandboxes: dict[str, Sandbox] = {}  # bound, warm and adopted, by lease id
        self._pending: dict[str, Sandbox] = {}  # waiting for a preparation slot, oldest first
        self._preparing = 0
        self._queue_rank: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._maintenance: asyncio.Task | None = None
        self._control = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix="sandbox-docker")
        self._execs = ThreadPoolExecutor(config.max_execs, thread_name_prefix="sandbox-exec")
        self._state = PoolState.load(state_path)
        self._acquire_to_ready_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._prepare_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._warm_retry_at: dict[str, float] = {}
        self._reaped = 0
        self._evicted_images = 0
        self._disk_bytes: dict[str, int] = {}  # host -> bytes, at the last maintenance
        self._disk_measured_at: dict[str, float] = {}  # host -> time.monotonic() of that measurement
        self._last_error: str | None = None

    # ---- lifecycle of the pool -------------------------------------------------------------

    async def start(self) -> None:
        """Connect, reclaim whatever a previous daemon of this cluster left, fill the warm pool."""
        if not self.config.enabled:
            return
        await self._check_hosts()
        await self._collect_previous_adoptions()
        await self._reap()
        self._refill_warm()
        self._maintenance = asyncio.create_task(self._maintain_forever())

    async def shutdown(self) -> None:
        """`down`: remove every container of the pool and stop its background work."""
        if self._maintenance is not None:
            self._maintenance.cancel()
            await asyncio.gather(self._maintenance, return_exceptions=True)
        await asyncio.gather(*(self._discard(sb) for sb in self._sandboxes.values()))
        self._sandboxes.clear()
        if self._tasks:
            # Preparations in flight see their sandbox released and remove what they created.
            await asyncio.wait(self._tasks, timeout=self.config.docker_timeout_s)
        self._state.save(self.state_path)
        for host in self.hosts:
            host.close()
        for executor in (self._control, self._execs):
            executor.shutdown(wait=False, cancel_futures=True)

    # ---- what agents ask for ---------------------------------------------------------------

    async def acquire(
        self,
        program_id: str,
        image: str | None = None,
        env: dict[str, str] | None = None,
        setup: str | None = None,
    ) -> Sandbox:
        """A sandbox for the program, at once: ready from the warm pool, else preparing."""
        self._require_available()
        image = image or self.config.image
        sandbox = self._claim_warm(image)
        if sandbox is None:
            sandbox = self._new_sandbox(image, self._pick_host(), program_id)
        sandbox.program_id = program_id
        sandbox.env = env or {}
        sandbox.requested_at = sandbox.last_used = time.monotonic()
        if setup:
            sandbox.pending_setups.append(setup)
            if sandbox.state is SandboxState.READY:
                sandbox.state = SandboxState.PREPARING
                sandbox.settled.clear()
                self._enqueue(sandbox)
        if sandbox.state is SandboxState.READY:
            self._acquire_to_ready_s.append(0.0)
        self._refill_warm()
        return sandbox

    async def adopt(self, program_id: str, docker_ids: list[str]) -> list[Sandbox]:
        """Take containers an agent started itself into the program: collected when it ends."""
        self._require_available()
        adopted = []
        for docker_id in docker_ids:
            sandbox = self._by_container(docker_id)
            if sandbox is None:
                host, info = await self._find_container(docker_id)
                sandbox = self._by_container(info.id) or self._adopt_container(program_id, host, info)
            adopted.append(sandbox)
        return adopted

    def get(self, sandbox_id: str) -> Sandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None or sandbox.is_warm:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found: released, expired or never created")
        return sandbox

    def sandboxes(self, program_id: str | None = None) -> list[Sandbox]:
        """Sandboxes bound to programs (all, or one program's); the warm pool is not listed."""
        return [
            sb for sb in self._sandboxes.values()
            if not sb.is_warm and (program_id is None or sb.program_id == program_id)
        ]

    async def wait_ready(self, sandbox_id: str, timeout_s: float) -> Sandbox:
        """The sandbox once ready or failed, or as it is after timeout_s."""
        sandbox = self.get(sandbox_id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sandbox.settled.wait(), timeout_s)
        return sandbox

    async def exec(self, sandbox_id: str, cmd: str | list[str], timeout_s: float | None = None) -> ExecResult:
        """Run a command (a string goes through /bin/sh -c), waiting for preparation first."""
        sandbox = self.get(sandbox_id)
        await sandbox.settled.wait()
        self._raise_unless_ready(sandbox)
        timeout_s = min(timeout_s or self.config.exec_timeout_s, self.config.exec_timeout_s)
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
        sandbox.last_used = time.monotonic()
        try:
            result = await self._run_exec(sandbox, argv, timeout_s)
        except DOCKER_ERRORS as exc:
            self._raise_unless_ready(sandbox)
            raise SandboxError(f"exec in sandbox {sandbox_id!r} on {sandbox.host.url} failed: {exc}") from exc
        sandbox.last_used = time.monotonic()
        return result

    async def release(self, sandbox_id: str) -> None:
        sandbox = self.get(sandbox_id)
        del self._sandboxes[sandbox.id]
        await self._discard(sandbox)

    # ---- what the daemon tells it ----------------------------------------------------------

    async def program_ended(self, program_id: str) -> int:
        """Release (kill and remove) every sandbox and adopted container of the program."""
        ended = self.sandboxes(program_id)
        for sandbox in ended:
            del self._sandboxes[sandbox.id]
        await asyncio.gather(*(self._discard(sb) for sb in ended))
        return len(ended)

    def program_queue(self, ordered_program_ids: list[str]) -> None:
        """The scheduler's current resume order of waiting programs: preparation follows it."""
        self._queue_rank = {program_id: rank for rank, program_id in enumerate(ordered_program_ids)}

    # ---- status ----------------------------------------------------------------------------

    def stats(self) -> dict:
        records = list(self._sandboxes.values())

        def count(state: SandboxState, warm: bool) -> int:
            return sum(1 for sb in records if sb.state is state and sb.is_warm is warm)

        unavailable = [host.reason for host in self.hosts if not host.available]
        available = self.config.enabled and len(unavailable) < len(self.hosts)
        reason = None if available else ("disabled in the profile" if not self.config.enabled
                                         else "; ".join(r for r in unavailable if r))
        return {
            "enabled": self.config.enabled,
            "available": available,
            "reason": reason,
            "hosts": [
                {"url": h.url, "available": h.available, "reason": h.reason,
                 "sandboxes": sum(1 for sb in records if sb.host is h),
                 "disk_bytes": self._disk_bytes.get(h.url),
                 "disk_age_s": (time.monotonic() - self._disk_measured_at[h.url]
                                if h.url in self._disk_measured_at else None)}
                for h in self.hosts
            ],
            "warm": count(SandboxState.READY, warm=True),
            "bound": count(SandboxState.READY, warm=False),
            "preparing": sum(1 for sb in records if sb.state is SandboxState.PREPARING),
            "failed": count(SandboxState.FAILED, warm=False),
            "adopted": sum(1 for sb in records if sb.adopted),
            "queued_for_preparation": len(self._pending),
            "acquire_to_ready_s": percentiles(self._acquire_to_ready_s),
            "prepare_s": percentiles(self._prepare_s),
            "disk_bytes": sum(self._disk_bytes.values()) if self._disk_bytes else None,
            "disk_high_watermark_bytes": self.config.disk_high_watermark_bytes,
            "reaped": self._reaped,
            "evicted_images": self._evicted_images,
            "last_error": self._last_error,
        }

    # ---- preparation -----------------------------------------------------------------------

    def _priority(self, sandbox: Sandbox) -> tuple[int, int]:
        # Running programs (not in the waiting queue) need their sandbox now; waiting ones in
        # the order they will get GPU memory back; the warm pool takes what is left.
        if sandbox.program_id is None:
            return (2, 0)
        rank = self._queue_rank.get(sandbox.program_id)
        return (0, 0) if rank is None else (1, rank)

    def _enqueue(self, sandbox: Sandbox) -> None:
        self._pending[sandbox.id] = sandbox
        # Dispatch on the loop's next turn, so that sandboxes asked for together (one scheduler
        # tick's worth) start in priority order rather than in the order they were asked for.
        asyncio.get_running_loop().call_soon(self._start_preparations)

    def _start_preparations(self) -> None:
        while self._preparing < self.config.prepare_concurrency and self._pending:
            # min() keeps the first of equals: oldest request first within a priority.
            sandbox = min(self._pending.values(), key=self._priority)
            del self._pending[sandbox.id]
            self._preparing += 1
            self._spawn(self._prepare_in_slot(sandbox))

    async def _prepare_in_slot(self, sandbox: Sandbox) -> None:
        try:
            await self._prepare(sandbox)
        finally:
            self._preparing -= 1
            self._start_preparations()

    async def _prepare(self, sandbox: Sandbox) -> None:
        if sandbox.state is SandboxState.RELEASED:
            return  # released between its dispatch and now
        started = time.monotonic()
        try:
            if sandbox.container_id is None:
                await self._create_container(sandbox)
            while sandbox.pending_setups and sandbox.state is SandboxState.PREPARING:
                await self._run_setup(sandbox, sandbox.pending_setups.pop(0))
        except FAILURES as exc:
            await self._fail(sandbox, str(exc))
            return
        if sandbox.state is SandboxState.RELEASED:
            await self._remove_container(sandbox)  # released while its container was being made
            return
        now = time.monotonic()
        sandbox.state = SandboxState.READY
        sandbox.settled.set()
        self._prepare_s.append(now - started)
        if not sandbox.is_warm:
            self._acquire_to_ready_s.append(now - sandbox.requested_at)

    async def _create_container(self, sandbox: Sandbox) -> None:
        host = sandbox.host
        if await self._run(host.ensure_image, sandbox.image):
            self._state.pulled.setdefault(host.url, {})[sandbox.image] = time.time()
            self._state.save(self.state_path)
        elif sandbox.image in self._state.pulled.get(host.url, {}):
            self._state.pulled[host.url][sandbox.image] = time.time()
        sandbox.container_id = await self._run(host.create, sandbox.image, sandbox.id, sandbox.program_id)

    async def _run_setup(self, sandbox: Sandbox, command: str) -> None:
        result = await self._run_exec(sandbox, ["/bin/sh", "-c", command], self.config.prepare_timeout_s)
        if result.exit_code != 0 and sandbox.state is not SandboxState.RELEASED:
            how = f"timed out after {self.config.prepare_timeout_s:g} s" if result.timed_out \
                else f"exited {result.exit_code}"
            raise SandboxFailed(
                f"setup {command!r} of sandbox {sandbox.id} ({sandbox.image} on {sandbox.host.url}) "
                f"{how}: {result.output[-SETUP_OUTPUT_TAIL:]}"
            )

    async def _fail(self, sandbox: Sandbox, error: str) -> None:
        if sandbox.state is SandboxState.RELEASED:
            await self._remove_container(sandbox)
            return
        log.warning("sandbox %s: %s", sandbox.id, error)
        self._last_error = error
        if sandbox.is_warm:
            # A broken image must not spin: try the warm pool again at the next maintenance.
            self._warm_retry_at[sandbox.image] = time.monotonic() + self.config.maintenance_interval_s
            self._sandboxes.pop(sandbox.id, None)
        sandbox.state, sandbox.error = SandboxState.FAILED, error
        sandbox.settled.set()
        await self._remove_container(sandbox)

    # ---- warm pool ---------------------------------------------------------------------------

    def _claim_warm(self, image: str) -> Sandbox | None:
        spare = [sb for sb in self._sandboxes.values()
                 if sb.is_warm and sb.image == image and sb.state in (SandboxState.READY, SandboxState.PREPARING)]
        # A ready one at once; else one already under way beats starting from nothing.
        return min(spare, key=lambda sb: sb.state is not SandboxState.READY, default=None)

    def _refill_warm(self) -> None:
        if not self.config.enabled or not any(h.available for h in self.hosts):
            return
        now = time.monotonic()
        for image, target in self.config.warm_targets().items():
            if now < self._warm_retry_at.get(image, 0.0):
                continue
            spare = sum(1 for sb in self._sandboxes.values() if sb.is_warm and sb.image == image)
            for _ in range(target - spare):
                self._new_sandbox(image, self._pick_host(), program_id=None)

    def _new_sandbox(self, image: str, host: DockerHost, program_id: str | None) -> Sandbox:
        setups = [self.config.setup] if self.config.setup and image == self.config.image else []
        sandbox = self._register(Sandbox(
            id=self._new_lease(), image=image, host=host, program_id=program_id, pending_setups=setups,
        ))
        self._enqueue(sandbox)
        return sandbox

    # ---- reclaiming --------------------------------------------------------------------------

    async def _discard(self, sandbox: Sandbox) -> None:
        """Forget the sandbox and remove its container (if a preparation holds it, it will)."""
        sandbox.state = SandboxState.RELEASED
        sandbox.settled.set()
        self._pending.pop(sandbox.id, None)
        if sandbox.adopted:
            self._state.adopted = [a for a in self._state.adopted if a.container_id != sandbox.container_id]
            self._state.save(self.state_path)
        await self._remove_container(sandbox)

    async def _remove_container(self, sandbox: Sandbox) -> None:
        if sandbox.container_id is None or not sandbox.host.available:
            return  # the reaper removes it once the host answers again
        try:
            await self._run(sandbox.host.remove, sandbox.container_id)
        except DOCKER_ERRORS as exc:
            log.warning("removing container %s of sandbox %s: %s", sandbox.container_id, sandbox.id, exc)

    async def _reap(self) -> None:
        """Remove this cluster's sandbox containers that no live sandbox owns; replace dead warm ones."""
        for host in (h for h in self.hosts if h.available):
            try:
                containers = await self._run(host.sandbox_containers)
            except DOCKER_ERRORS as exc:
                log.warning("listing containers on %s: %s", host.url, exc)
                continue
            by_lease = {c.labels.get(LABEL_LEASE): c for c in containers}
            orphans = [c for lease, c in by_lease.items() if lease not in self._sandboxes]
            await asyncio.gather(*(self._reap_container(host, c.id) for c in orphans))
            dead_warm = [
                self._sandboxes.pop(sb.id) for sb in list(self._sandboxes.values())
                if sb.host is host and sb.is_warm and sb.state is SandboxState.READY
                and not getattr(by_lease.get(sb.id), "running", False)
            ]
            await asyncio.gather(*(self._discard(sb) for sb in dead_warm))

    async def _reap_container(self, host: DockerHost, container_id: str) -> None:
        try:
            await self._run(host.remove, container_id)
            self._reaped += 1
        except DOCKER_ERRORS as exc:
            log.warning("reaping container %s on %s: %s", container_id, host.url, exc)

    async def _collect_previous_adoptions(self) -> None:
        """Containers adopted by programs of a daemon that died: those programs are gone."""
        hosts = {h.url: h for h in self.hosts if h.available}
        kept = []
        for adopted in self._state.adopted:
            host = hosts.get(adopted.host)
            if host is None:
                kept.append(adopted)  # its host does not answer now; try at the next start
                continue
            await self._reap_container(host, adopted.container_id)
        self._state.adopted = kept
        self._state.save(self.state_path)

    def _expire_idle(self) -> None:
        if self.config.idle_expiry_s is None:
            return
        cutoff = time.monotonic() - self.config.idle_expiry_s
        for sandbox in [sb for sb in self._sandboxes.values() if not sb.is_warm
                        and sb.state is not SandboxState.PREPARING and sb.last_used < cutoff]:
            log.info("sandbox %s of program %s idle for %.0f s: released", sandbox.id,
                     sandbox.program_id, self.config.idle_expiry_s)
            del self._sandboxes[sandbox.id]
            self._spawn(self._discard(sandbox))

    async def _check_disk(self) -> None:
        """Measure each host's disk use by the pool; above the watermark, evict pulled images."""
        for host in (h for h in self.hosts if h.available):
            pulled = self._state.pulled.get(host.url, {})
            usage = await self._run(host.disk_usage, set(pulled))
            used = usage.containers_bytes + usage.pulled_images_bytes
            # Least recently used first, until back under the watermark.
            for image in sorted(usage.unused_images, key=lambda name: pulled[name]):
                if used <= self.config.disk_high_watermark_bytes:
                    break
                await self._run(host.remove_image, image)
                log.info("evicted image %s from %s: disk above the high watermark", image, host.url)
                del pulled[image]
                used -= usage.unused_images[image]
                self._evicted_images += 1
            self._disk_bytes[host.url] = used
            self._disk_measured_at[host.url] = time.monotonic()
        self._state.save(self.state_path)

    # ---- maintenance ---------------------------------------------------------------------------

    async def maintain(self) -> None:
        """One round of what runs every maintenance interval; public so tests need not wait."""
        await self._check_hosts()
        await self._reap()
        self._expire_idle()
        await self._check_disk()
        self._refill_warm()

    async def _maintain_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.maintenance_interval_s)
            try:
                await self.maintain()
            except FAILURES as exc:
                log.warning("sandbox maintenance: %s", exc)

    async def _check_hosts(self) -> None:
        await asyncio.gather(*(self._run(host.connect) for host in self.hosts))

    # ---- helpers -------------------------------------------------------------------------------

    def _require_available(self) -> None:
        if not self.config.enabled:
            raise PoolUnavailable("sandboxes are disabled in this profile")
        if not any(h.available for h in self.hosts):
            raise PoolUnavailable("no Docker engine answers: " + "; ".join(h.reason or h.url for h in self.hosts))

    def _raise_unless_ready(self, sandbox: Sandbox) -> None:
        if sandbox.state is SandboxState.RELEASED:
            raise SandboxNotFound(f"sandbox {sandbox.id!r} was released")
        if sandbox.state is SandboxState.FAILED:
            raise SandboxFailed(sandbox.error or f"sandbox {sandbox.id!r} failed")

    def _pick_host(self) -> DockerHost:
        available = [h for h in self.hosts if h.available]
        if not available:
            self._require_available()
        return min(available, key=lambda h: sum(1 for sb in self._sandboxes.values() if sb.host is h))

    async def _find_container(self, docker_id: str) -> tuple[DockerHost, ContainerInfo]:
        for host in (h for h in self.hosts if h.available):
            info = await self._run(host.inspect, docker_id)
            if info is None:
                continue
            if info.labels.get(LABEL_CLUSTER) == self.cluster and info.labels.get(LABEL_LEASE) not in self._sandboxes:
                break  # a sandbox of ours about to be reaped, or a worker: not the agent's to keep
            return host, info
        urls = ", ".join(h.url for h in self.hosts)
        raise SandboxNotFound(f"container {docker_id!r} is on no Docker host of this pool ({urls})")

    def _by_container(self, docker_id: str) -> Sandbox | None:
        """The sandbox whose container has this id, or this id's first 12+ digits as `docker ps`
        shows them. Clients send the same ids with every request: known ones cost no Docker call."""
        if len(docker_id) < SHORT_ID_LENGTH or not all(c in hexdigits for c in docker_id):
            return None  # perhaps a container name: only Docker can resolve it
        return next((sb for sb in self._sandboxes.values()
                     if sb.container_id and sb.container_id.startswith(docker_id.lower())), None)

    def _adopt_container(self, program_id: str, host: DockerHost, info: ContainerInfo) -> Sandbox:
        sandbox = self._register(Sandbox(
            id=self._new_lease(), image=info.image, host=host, program_id=program_id,
            state=SandboxState.READY, container_id=info.id, adopted=True,
        ))
        sandbox.settled.set()
        self._state.adopted.append(AdoptedContainer(host=host.url, container_id=info.id))
        self._state.save(self.state_path)
        return sandbox

    def _register(self, sandbox: Sandbox) -> Sandbox:
        self._sandboxes[sandbox.id] = sandbox
        return sandbox

    @staticmethod
    def _new_lease() -> str:
        return f"sbx-{secrets.token_hex(6)}"

    def _spawn(self, coroutine: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, function: Callable[..., T], *args: object) -> T:
        """A short blocking Docker call, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._control, functools.partial(function, *args))

    async def _run_exec(self, sandbox: Sandbox, argv: list[str], timeout_s: float) -> ExecResult:
        """A command in the sandbox: holds one exec thread for as long as it runs."""
        assert sandbox.container_id is not None, "only a sandbox with a container runs commands"
        loop = asyncio.get_running_loop()
        run = functools.partial(sandbox.host.exec, sandbox.container_id, argv, sandbox.env, timeout_s)
        return await loop.run_in_executor(self._execs, run)
