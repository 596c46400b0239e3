"""Who is admitted (the head of the queue that fits) and which worker a program is placed on: where its KV is
(or, new, its shared prefix) while the cluster has room for everyone, else the most headroom."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from thunderctl.scheduler.capacity import headroom
from thunderctl.scheduler.config import PlacementRule, SchedulerConfig
from thunderctl.scheduler.ledger import Load
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


def fits(program: Program, worker: Worker, load: Load, config: SchedulerConfig) -> bool:
    """Whether the program fits the worker's resume band on top of `load`."""
    # An idle worker takes any program: otherwise one larger than the resume band
    # would wait for its forced resume while the engine sits empty.
    need = load.need(program, 1.0, config.admission.buffer_tokens)
    return not worker.programs or need <= headroom(worker, load, config.admission.resume_threshold)


def admit_in_order(
    queue: Iterable[Program], targets: list[Worker], loads: dict[str, Load], config: SchedulerConfig
) -> list[Program]:
    """The head of the queue that fits in the total headroom; nobody jumps the queue."""
    room = sum(headroom(b, loads[b.id], config.admission.resume_threshold) for b in targets)
    chosen = []
    for program in queue:
        need = program.tokens + config.admission.buffer_tokens
        if need > room and not any(not b.programs for b in targets):
            break
        room -= need
        chosen.append(program)
    return chosen


def fit(
    program: Program,
    targets: list[Worker],
    loads: dict[str, Load],
    contended: bool,
    config: SchedulerConfig,
    workers: Mapping[str, Worker],
) -> Worker | None:
    """The worker among `targets` the program goes to (`choose`), or None when it fits none."""
    home = workers.get(program.worker or "")
    if home is not None and home.host_capacity and home in targets:
        targets = [home]  # its KV waits in that host tier: back by a transfer there, by a prefill elsewhere
    fitting = [b for b in targets if fits(program, b, loads[b.id], config)]
    if not fitting:
        return None
    mean_load = sum(loads[b.id].tokens for b in targets) / len(targets)
    return choose(
        config.placement, program, fitting, list(workers),
        headroom=lambda b: headroom(b, loads[b.id], config.admission.resume_threshold), contended=contended,
        prefix_home=lambda b: loads[b.id].holds(program.prefix_key) and loads[b.id].tokens <= mean_load,
    )  # fmt: skip


def placements(
    chosen: list[Program],
    waiting: int,
    targets: list[Worker],
    loads: dict[str, Load],
    config: SchedulerConfig,
    workers: Mapping[str, Worker],
) -> Iterator[tuple[Program, Worker]]:
    """Where each of the `chosen` goes, the largest first, while `waiting` programs wait in all:
    while others are left waiting, or some chosen program fits no worker, the room decides (best
    fit decreasing, onto the most headroom). The caller charges each on `loads` before the next."""
    left_waiting = waiting > sum(p.waiting_since is not None for p in chosen)
    contended = left_waiting or not all(any(fits(p, b, loads[b.id], config) for b in targets) for p in chosen)
    for program in sorted(chosen, key=lambda p: p.tokens, reverse=True):
        worker = fit(program, targets, loads, contended, config, workers)
        if worker is not None:
            yield program, worker
