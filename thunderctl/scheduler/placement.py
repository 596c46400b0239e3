"""Which worker a program is placed on: where its KV is (or, new, its shared prefix) while the cluster has room
for everyone, else the most headroom."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from thunderctl.scheduler.config import PlacementRule
from thunderctl.scheduler.program import Program, Worker


def home(program_id: str, worker_ids: Sequence[str]) -> str:
    """The worker a program's id hashes to: CRC-32 modulo the workers in the order they were
    added, the pin a hash-routing client (an agent harness, a KV-aware router) gives it."""
    return worker_ids[zlib.crc32(program_id.encode()) % len(worker_ids)]


def preferred(program: Program, worker_ids: Sequence[str]) -> str:
    """Where the program's KV is: the worker it last ran on (its prefix cache, its host tier),
    or, new, its hash home."""
    return program.worker if program.worker is not None else home(program.id, worker_ids)


def choose(
    rule: PlacementRule,
    program: Program,
    fitting: Sequence[Worker],
    worker_ids: Sequence[str],
    headroom: Callable[[Worker], float],
    contended: bool,
    prefix_home: Callable[[Worker], bool] = lambda worker: False,
) -> Worker:
    """One of the workers the program fits on (non-empty): its preferred one when the rule is
    affinity and nobody else waits for room, otherwise the one with the most headroom.

    Under affinity a program with no history (its first request, or one that continues no
    conversation) has no KV anywhere but its shared prefix: it goes among its `prefix_home`s
    (workers that hold the prefix and are not overloaded: they carry no more than the workers'
    mean load), when one of them fits it, rather than to its hash home or the roomiest worker.
    """
    if rule is PlacementRule.AFFINITY and program.worker is None:
        fitting = [worker for worker in fitting if prefix_home(worker)] or fitting
    if rule is PlacementRule.AFFINITY and not contended:
        target = preferred(program, worker_ids)
        for worker in fitting:
            if worker.id == target:
                return worker
    return max(fitting, key=headroom)
