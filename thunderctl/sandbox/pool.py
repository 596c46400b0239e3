"""The sandbox pool: per-program Docker sandboxes, handed out warm or prepared, reclaimed with their program.

Sandboxes live on one or more engines, are prepared in the background in the scheduler's resume
order and kept warm per image. The pool knows programs only by id: the daemon calls it on
lifecycle events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Collection
from pathlib import Path
from string import hexdigits

from thunderctl.sandbox.adoption import adoption_refusal, holder_refusal
from thunderctl.sandbox.calls import HostCalls
from thunderctl.sandbox.config import SandboxConfig
from thunderctl.sandbox.docker_host import DOCKER_ERRORS, DockerHost
from thunderctl.sandbox.host import ContainerInfo, ExecResult, HostFactory, SandboxError, SandboxHost
from thunderctl.sandbox.lease import (
    FAILURES,
    AdoptionRefused,
    PoolUnavailable,
    Sandbox,
    SandboxNotFound,
    SandboxState,
)
from thunderctl.sandbox.preparation import Preparation
from thunderctl.sandbox.rebinding import rebind, record_of
from thunderctl.sandbox.reclaim import Reclaimer, Sweep
from thunderctl.sandbox.state import PoolState
from thunderctl.sandbox.stats import PoolCounters, pool_stats

log = logging.getLogger(__name__)

SHORT_ID_LENGTH = 12  # digits of a container id that `docker ps` shows


class SandboxPool:
    def __init__(
        self,
        config: SandboxConfig,
        cluster: str,
        state_path: Path | None = None,
        host_factory: HostFactory = DockerHost,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,  # to compare with Docker's creation times
    ) -> None:
        self.config = config
        self.cluster = cluster
        self.state_path = state_path
        self.hosts: list[SandboxHost] = [host_factory(url, config, cluster) for url in config.hosts]
        self._clock = clock
        self._wall_clock = wall_clock
        self._began: dict[str, float] = {}  # program -> when it was first heard of (wall clock)
        self._sandboxes: dict[str, Sandbox] = {}  # bound, warm and adopted, by lease id
        self._maintenance: asyncio.Task | None = None
        self._calls = HostCalls(config)
        self._state = PoolState.load(state_path)
        self._counters = PoolCounters()
        self._warm_retry_at: dict[str, float] = {}
        self._reclaimer = Reclaimer(
            config, self.hosts, self._sandboxes, self._calls, self._state, self._save_state, self._counters, clock
        )
        self._preparation = Preparation(
            config,
            self._calls,
            self._state,
            self._save_state,
            self._counters,
            clock,
            self._reclaimer.remove_container,
            self._on_failed,
            self._remember,
        )

    # ---- lifecycle of the pool -------------------------------------------------------------

    async def start(self, live_programs: Collection[str] = ()) -> None:
        """Connect, bind again the sandboxes a previous daemon of this cluster left to the programs
        that live on in this one (`live_programs`, restored from its journal), reclaim whatever else
        it left (warm sandboxes too: the warm pool is filled afresh), fill the warm pool."""
        if not self.config.enabled:
            return
        await self._check_hosts()
        await self._rebind(live_programs)
        await self._reclaimer.collect_previous_adoptions()
        await self._reclaimer.reap()
        self._refill_warm()
        self._maintenance = asyncio.create_task(self._maintain_forever())

    async def shutdown(self) -> None:
        """`down`: remove every container of the pool and stop its background work."""
        if self._maintenance is not None:
            self._maintenance.cancel()
            await asyncio.gather(self._maintenance, return_exceptions=True)
        await asyncio.gather(*(self._discard(sb) for sb in self._sandboxes.values()))
        self._sandboxes.clear()
        # Preparations in flight see their sandbox released and remove what they created.
        await self._calls.settle(self.config.docker_timeout_s)
        self._save_state()
        for host in self.hosts:
            host.close()
        self._calls.close()

    async def sweep(self) -> Sweep:
        """`down`, once the daemon is gone, in place of `start`: remove what the cluster's pools
        left on these hosts (its sandboxes by their labels, the containers its programs adopted
        by the state file), and name what could not be removed: kept in the state file for the next."""
        await self._check_hosts()
        await self._rebind(live_programs=())
        await self._reclaimer.collect_previous_adoptions()
        left = await self._reclaimer.reap()
        recorded = self._state.hosts_to_sweep()
        left += [f"{h.reason or h.url}" for h in self.hosts if not h.available and h.url in recorded]
        left += [f"container {a.container_id[:12]} adopted on {a.host}" for a in self._state.adopted]
        for host in self.hosts:
            host.close()
        self._calls.close()
        return Sweep(self._counters.reaped, left)

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
        self.program_began(program_id)
        image = image or self.config.image
        sandbox = self._claim_warm(image)
        if sandbox is None:
            sandbox = self._new_sandbox(image, self._pick_host(), program_id)
        sandbox.program_id = program_id
        sandbox.env = env or {}
        sandbox.requested_at = sandbox.last_used = self._clock()
        if setup:
            sandbox.pending_setups.append(setup)
            if sandbox.state is SandboxState.READY:
                sandbox.state = SandboxState.PREPARING
                sandbox.settled.clear()
                self._preparation.enqueue(sandbox)
        if sandbox.state is SandboxState.READY:
            self._counters.acquire_to_ready_s.append(0.0)
            self._remember(sandbox)
        self._refill_warm()
        return sandbox

    async def adopt(self, program_id: str, docker_ids: list[str]) -> list[Sandbox]:
        """Take containers an agent started itself into the program: collected when it ends.
        All or none: `AdoptionRefused` (why, for the client) if one of them may not be adopted."""
        self._require_available()
        self.program_began(program_id)  # when an adoption is its first word, older containers are not its own
        taken: dict[str, Sandbox | tuple[SandboxHost, ContainerInfo]] = {}
        for docker_id in docker_ids:
            found = await self._adoptable(program_id, docker_id)
            container_id = found.container_id if isinstance(found, Sandbox) else found[1].id
            taken.setdefault(container_id or docker_id, found)
        return [
            found if isinstance(found, Sandbox) else self._adopt_container(program_id, *found)
            for found in taken.values()
        ]

    def get(self, sandbox_id: str) -> Sandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None or sandbox.is_warm:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found: released, expired or never created")
        return sandbox

    def sandboxes(self, program_id: str | None = None) -> list[Sandbox]:
        """Sandboxes bound to programs (all, or one program's); the warm pool is not listed."""
        return [
            sb
            for sb in self._sandboxes.values()
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
        sandbox.raise_unless_ready()
        timeout_s = min(timeout_s or self.config.exec_timeout_s, self.config.exec_timeout_s)
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
        sandbox.last_used = self._clock()
        try:
            result = await self._calls.exec(sandbox, argv, timeout_s)
        except DOCKER_ERRORS as exc:
            sandbox.raise_unless_ready()
            raise SandboxError(f"exec in sandbox {sandbox_id!r} on {sandbox.host.url} failed: {exc}") from exc
        sandbox.last_used = self._clock()
        return result

    async def release(self, sandbox_id: str) -> None:
        sandbox = self.get(sandbox_id)
        del self._sandboxes[sandbox.id]
        await self._discard(sandbox)

    # ---- what the daemon tells it ----------------------------------------------------------

    def program_began(self, program_id: str) -> None:
        """The program's first request (the daemon calls this on the scheduler's `created`, the
        pool on a program's first sandbox request): it may adopt only containers made after it."""
        self._began.setdefault(program_id, self._wall_clock())

    async def program_ended(self, program_id: str) -> int:
        """Release (kill and remove) every sandbox and adopted container of the program."""
        self._began.pop(program_id, None)
        ended = self.sandboxes(program_id)
        for sandbox in ended:
            del self._sandboxes[sandbox.id]
        await asyncio.gather(*(self._discard(sb) for sb in ended))
        return len(ended)

    def program_queue(self, ordered_program_ids: list[str]) -> None:
        """The scheduler's current resume order of waiting programs: preparation follows it."""
        self._preparation.follow_queue(ordered_program_ids)

    # ---- status and maintenance ------------------------------------------------------------

    def stats(self) -> dict:
        return pool_stats(
            self.config,
            self.hosts,
            list(self._sandboxes.values()),
            self._preparation.queued,
            self._counters,
            self._clock(),
        )

    async def maintain(self) -> None:
        """One round of what runs every maintenance interval; public so tests need not wait."""
        await self._check_hosts()
        await self._reclaimer.reap()
        for sandbox in self._reclaimer.expire_idle():
            self._calls.spawn(self._discard(sandbox))
        await self._reclaimer.check_disk()
        self._refill_warm()

    async def _maintain_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.maintenance_interval_s)
            try:
                await self.maintain()
            except FAILURES as exc:
                log.warning("sandbox maintenance: %s", exc)

    async def _check_hosts(self) -> None:
        await asyncio.gather(*(self._calls.run(host.connect) for host in self.hosts))

    # ---- warm pool -------------------------------------------------------------------------

    def _claim_warm(self, image: str) -> Sandbox | None:
        spare = [
            sb
            for sb in self._sandboxes.values()
            if sb.is_warm and sb.image == image and sb.state in (SandboxState.READY, SandboxState.PREPARING)
        ]
        # A ready one at once; else one already under way beats starting from nothing.
        return min(spare, key=lambda sb: sb.state is not SandboxState.READY, default=None)

    def _refill_warm(self) -> None:
        if not self.config.enabled or not any(h.available for h in self.hosts):
            return
        now = self._clock()
        for image, target in self.config.warm_targets().items():
            if now < self._warm_retry_at.get(image, 0.0):
                continue
            spare = sum(1 for sb in self._sandboxes.values() if sb.is_warm and sb.image == image)
            for _ in range(target - spare):
                self._new_sandbox(image, self._pick_host(), program_id=None)

    def _on_failed(self, sandbox: Sandbox) -> None:
        if sandbox.is_warm:
            # A broken image must not spin: try the warm pool again at the next maintenance.
            self._warm_retry_at[sandbox.image] = self._clock() + self.config.maintenance_interval_s
            self._sandboxes.pop(sandbox.id, None)

    def _new_sandbox(self, image: str, host: SandboxHost, program_id: str | None) -> Sandbox:
        setups = [self.config.setup] if self.config.setup and image == self.config.image else []
        now = self._clock()
        sandbox = self._register(
            Sandbox(
                id=self._new_lease(),
                image=image,
                host=host,
                requested_at=now,
                last_used=now,
                program_id=program_id,
                pending_setups=setups,
            )
        )
        self._preparation.enqueue(sandbox)
        return sandbox

    # ---- the registry ----------------------------------------------------------------------

    async def _discard(self, sandbox: Sandbox) -> None:
        """A sandbox out of the registry: out of the preparation queue too, its container removed."""
        self._preparation.cancel(sandbox)
        await self._reclaimer.discard(sandbox)

    def _require_available(self) -> None:
        if not self.config.enabled:
            raise PoolUnavailable("sandboxes are disabled in this profile")
        if not any(h.available for h in self.hosts):
            raise PoolUnavailable("no Docker engine answers: " + "; ".join(h.reason or h.url for h in self.hosts))

    def _pick_host(self) -> SandboxHost:
        available = [h for h in self.hosts if h.available]
        if not available:
            self._require_available()
        return min(available, key=lambda h: sum(1 for sb in self._sandboxes.values() if sb.host is h))

    async def _adoptable(self, program_id: str, docker_id: str) -> Sandbox | tuple[SandboxHost, ContainerInfo]:
        """What `docker_id` names, if the program may adopt it (else `AdoptionRefused`): a sandbox
        of its own, handed back, or a container no sandbox of the pool holds, and where it is."""
        sandbox = self._by_container(docker_id)
        if sandbox is None:  # a container name, or one the pool does not hold: Docker knows
            host, info = await self._find_container(docker_id)
            sandbox = self._by_container(info.id)
            if sandbox is None:
                refusal = adoption_refusal(info, self.cluster, self.config.adopt, program_id, self._began[program_id])
                if refusal is not None:
                    raise AdoptionRefused(refusal)
                return host, info
        refusal = holder_refusal(sandbox, program_id)
        if refusal is not None:
            raise AdoptionRefused(refusal)
        return sandbox

    async def _find_container(self, docker_id: str) -> tuple[SandboxHost, ContainerInfo]:
        for host in (h for h in self.hosts if h.available):
            info = await self._calls.run(host.inspect, docker_id)
            if info is not None:
                return host, info
        urls = ", ".join(h.url for h in self.hosts)
        raise SandboxNotFound(f"container {docker_id!r} is on no Docker host of this pool ({urls})")

    def _by_container(self, docker_id: str) -> Sandbox | None:
        """The sandbox whose container has this id, or this id's first 12+ digits as `docker ps`
        shows them. Clients send the same ids with every request: known ones cost no Docker call."""
        if len(docker_id) < SHORT_ID_LENGTH or not all(c in hexdigits for c in docker_id):
            return None  # perhaps a container name: only Docker can resolve it
        return next(
            (
                sb
                for sb in self._sandboxes.values()
                if sb.container_id and sb.container_id.startswith(docker_id.lower())
            ),
            None,
        )

    def _adopt_container(self, program_id: str, host: SandboxHost, info: ContainerInfo) -> Sandbox:
        now = self._clock()
        sandbox = self._register(
            Sandbox(
                id=self._new_lease(),
                image=info.image,
                host=host,
                requested_at=now,
                last_used=now,
                program_id=program_id,
                state=SandboxState.READY,
                container_id=info.id,
                adopted=True,
            )
        )
        sandbox.settled.set()
        self._remember(sandbox)
        return sandbox

    async def _rebind(self, live_programs: Collection[str]) -> None:
        """Register the sandboxes of the state file whose program lives on. The other adopted
        containers are left for `collect_previous_adoptions`; the other made ones, for the reaper."""
        hosts, live = {h.url: h for h in self.hosts}, set(live_programs)
        now = self._clock()
        made = await rebind(self._state.made, False, live, hosts, self._calls, now)
        adopted = await rebind(self._state.adopted, True, live, hosts, self._calls, now)
        for sandbox in made + adopted:
            self._register(sandbox)
            log.info("sandbox %s of program %s bound again", sandbox.id, sandbox.program_id)
        self._state.made = [record_of(sb) for sb in made]
        self._save_state()

    def _remember(self, sandbox: Sandbox) -> None:
        """A sandbox bound to a program is ready: recorded at once, so that a daemon that dies
        next leaves it to the next daemon."""
        (self._state.adopted if sandbox.adopted else self._state.made).append(record_of(sandbox))
        self._save_state()

    def _register(self, sandbox: Sandbox) -> Sandbox:
        self._sandboxes[sandbox.id] = sandbox
        return sandbox

    def _save_state(self) -> None:
        self._state.save(self.state_path)

    @staticmethod
    def _new_lease() -> str:
        return f"sbx-{secrets.token_hex(6)}"
