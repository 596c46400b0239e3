"""`thunderctl serve` as a subprocess, for benchmarks and tests that need a real gateway."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from thunderctl.engines.child import ChildServer
from thunderctl.gateway.auth import API_KEY_ENV, env_api_key
from thunderctl.jsonapi import bearer_headers


class ServeProcess(ChildServer):
    """A gateway in its own process (so it does not share the caller's GIL), stopped by pid."""

    what = "gateway"

    def __init__(
        self,
        workers: Sequence[str],
        options: Sequence[str],
        log_path: Path,
        api_key: str | None = None,
        pythonpath: Path | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        """`api_key` defaults to $THUNDERCTL_API_KEY, which the gateway would read anyway; `pythonpath`:
        the checkout whose thunderctl runs (default: the caller's); `prefix`: a command that runs
        the gateway's (a profiler's, as `valgrind --tool=callgrind`)."""
        self.api_key = api_key or env_api_key()

        def command(port: int) -> list[str]:
            command = [*prefix, sys.executable, "-m", "thunderctl", "serve", "--port", str(port)]
            for worker in workers:
                command += ["--worker", worker]
            return [*command, *options]

        # The key goes in the environment, out of the command line that `ps` shows.
        env = {**os.environ, API_KEY_ENV: self.api_key} if self.api_key else dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = str(pythonpath)
        super().__init__(command, log_path, env)

    @property
    def headers(self) -> dict[str, str]:
        """What a client of this gateway sends."""
        return bearer_headers(self.api_key)
