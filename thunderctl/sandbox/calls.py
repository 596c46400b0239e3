"""The pool's blocking host calls, off the event loop: short control calls, long execs, tasks."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from thunderctl.sandbox.config import CONTROL_THREADS, SandboxConfig
from thunderctl.sandbox.host import ExecResult
from thunderctl.sandbox.lease import Sandbox

T = TypeVar("T")


class HostCalls:
    """Two thread pools, so that long-running commands never hold up a release or a new sandbox,
    and the background tasks the pool must wait for at shutdown."""

    def __init__(self, config: SandboxConfig) -> None:
        self._control = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix="sandbox-docker")
        self._execs = ThreadPoolExecutor(config.max_execs, thread_name_prefix="sandbox-exec")
        self._tasks: set[asyncio.Task] = set()

    async def run(self, function: Callable[..., T], *args: object) -> T:
        """A short blocking Docker call."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._control, functools.partial(function, *args))

    async def exec(self, sandbox: Sandbox, argv: list[str], timeout_s: float) -> ExecResult:
        """A command in the sandbox: holds one exec thread for as long as it runs."""
        assert sandbox.container_id is not None, "only a sandbox with a container runs commands"
        loop = asyncio.get_running_loop()
        run = functools.partial(sandbox.host.exec, sandbox.container_id, argv, sandbox.env, timeout_s)
        return await loop.run_in_executor(self._execs, run)

    def spawn(self, coroutine: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) for the background tasks in flight."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)

    def close(self) -> None:
        for executor in (self._control, self._execs):
            executor.shutdown(wait=False, cancel_futures=True)
