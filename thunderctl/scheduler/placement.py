"""Which backend a program is placed on: where its KV is while the cluster has room for everyone, else the most headroom."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from thunderctl.scheduler.config import PlacementRule
from thunderctl.scheduler.program import Backend, Program


def home(program_id: str, backend_ids: Sequence[str]) -> str:
    """The backend a program's id hashes to: CRC-32 modulo the backends in the order they were
    added, the pin a hash-routing client (an agent harness, a KV-aware router) gives it."""
    return backend_ids[zlib.crc32(program_id.encode()) % len(backend_ids)]


def preferred(program: Program, backend_ids: Sequence[str]) -> str:
    """Where the program's KV is: the backend it last ran on (its prefix cache, its host tier),
    or, new, its hash home."""
    return program.backend if program.backend is not None else home(program.id, backend_ids)


def choose(
    rule: PlacementRule,
    program: Program,
    fitting: Sequence[Backend],
    backend_ids: Sequence[str],
    headroom: Callable[[Backend], float],
    contended: bool,
) -> Backend:
    """One of the backends the program fits on (non-empty): its preferred one when the rule is
    affinity and nobody else waits for room, otherwise the one with the most headroom."""
    if rule is PlacementRule.AFFINITY and not contended:
        target = preferred(program, backend_ids)
        for backend in fitting:
            if backend.id == target:
                return backend
    return max(fitting, key=headroom)
