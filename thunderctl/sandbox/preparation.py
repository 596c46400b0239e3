"""Preparing sandboxes in the background, in the scheduler's resume order, a bounded number at a time.

Preparing one is creating its container (pulling its image if missing) and running its setup commands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from thunderctl.sandbox.calls import HostCalls
from thunderctl.sandbox.config import SandboxConfig
from thunderctl.sandbox.lease import FAILURES, Sandbox, SandboxFailed, SandboxState
from thunderctl.sandbox.state import PoolState
from thunderctl.sandbox.stats import PoolCounters

log = logging.getLogger(__name__)

SETUP_OUTPUT_TAIL = 2000  # characters of a failed setup's output quoted in its error


class Preparation:
    def __init__(
        self,
        config: SandboxConfig,
        calls: HostCalls,
        state: PoolState,
        save_state: Callable[[], None],
        counters: PoolCounters,
        clock: Callable[[], float],
        remove_container: Callable[[Sandbox], Awaitable[object]],
        on_failed: Callable[[Sandbox], None],
        on_bound_ready: Callable[[Sandbox], None],
    ) -> None:
        self.config = config
        self._calls = calls
        self._state = state
        self._save_state = save_state
        self._counters = counters
        self._clock = clock
        self._remove_container = remove_container
        self._on_failed = on_failed  # after a failure is recorded, before the sandbox settles
        self._on_bound_ready = on_bound_ready  # a sandbox of a program, once ready
        self._pending: dict[str, Sandbox] = {}  # waiting for a slot, oldest first
        self._preparing = 0
        self._queue_rank: dict[str, int] = {}

    @property
    def queued(self) -> int:
        return len(self._pending)

    def follow_queue(self, ordered_program_ids: list[str]) -> None:
        """The scheduler's current resume order of waiting programs."""
        self._queue_rank = {program_id: rank for rank, program_id in enumerate(ordered_program_ids)}

    def enqueue(self, sandbox: Sandbox) -> None:
        self._pending[sandbox.id] = sandbox
        # Dispatch on the loop's next turn, so that sandboxes asked for together (one scheduler
        # tick's worth) start in priority order rather than in the order they were asked for.
        asyncio.get_running_loop().call_soon(self._start_preparations)

    def cancel(self, sandbox: Sandbox) -> None:
        """The sandbox will not be needed: it gives up its place in the queue, if it has one."""
        self._pending.pop(sandbox.id, None)

    def _priority(self, sandbox: Sandbox) -> tuple[int, int]:
        # Running programs (not in the waiting queue) need their sandbox now; waiting ones in
        # the order they will get GPU memory back; the warm pool takes what is left.
        if sandbox.program_id is None:
            return (2, 0)
        rank = self._queue_rank.get(sandbox.program_id)
        return (0, 0) if rank is None else (1, rank)

    def _start_preparations(self) -> None:
        while self._preparing < self.config.prepare_concurrency and self._pending:
            # min() keeps the first of equals: oldest request first within a priority.
            sandbox = min(self._pending.values(), key=self._priority)
            del self._pending[sandbox.id]
            self._preparing += 1
            self._calls.spawn(self._prepare_in_slot(sandbox))

    async def _prepare_in_slot(self, sandbox: Sandbox) -> None:
        try:
            await self._prepare(sandbox)
        finally:
            self._preparing -= 1
            self._start_preparations()

    async def _prepare(self, sandbox: Sandbox) -> None:
        if sandbox.state is SandboxState.RELEASED:
            return  # released between its dispatch and now
        started = self._clock()
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
        now = self._clock()
        sandbox.state = SandboxState.READY
        sandbox.settled.set()
        self._counters.prepare_s.append(now - started)
        if not sandbox.is_warm:
            self._counters.acquire_to_ready_s.append(now - sandbox.requested_at)
            self._on_bound_ready(sandbox)

    async def _create_container(self, sandbox: Sandbox) -> None:
        host = sandbox.host
        # Wall time: the stamps outlive the process, in the state file.
        if await self._calls.run(host.ensure_image, sandbox.image):
            self._state.pulled.setdefault(host.url, {})[sandbox.image] = time.time()
            self._save_state()
        elif sandbox.image in self._state.pulled.get(host.url, {}):
            self._state.pulled[host.url][sandbox.image] = time.time()
        if host.url not in self._state.used_hosts:
            self._state.used_hosts.append(host.url)
            self._save_state()
        sandbox.container_id = await self._calls.run(host.create, sandbox.image, sandbox.id, sandbox.program_id)

    async def _run_setup(self, sandbox: Sandbox, command: str) -> None:
        result = await self._calls.exec(sandbox, ["/bin/sh", "-c", command], self.config.prepare_timeout_s)
        if result.exit_code != 0 and sandbox.state is not SandboxState.RELEASED:
            how = (
                f"timed out after {self.config.prepare_timeout_s:g} s"
                if result.timed_out
                else f"exited {result.exit_code}"
            )
            raise SandboxFailed(
                f"setup {command!r} of sandbox {sandbox.id} ({sandbox.image} on {sandbox.host.url}) "
                f"{how}: {result.output[-SETUP_OUTPUT_TAIL:]}"
            )

    async def _fail(self, sandbox: Sandbox, error: str) -> None:
        if sandbox.state is SandboxState.RELEASED:
            await self._remove_container(sandbox)
            return
        log.warning("sandbox %s: %s", sandbox.id, error)
        self._counters.last_error = error
        self._on_failed(sandbox)
        sandbox.state, sandbox.error = SandboxState.FAILED, error
        sandbox.settled.set()
        await self._remove_container(sandbox)
