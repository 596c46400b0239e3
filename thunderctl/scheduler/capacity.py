"""A worker's room: one level of KV, or two with a host tier (what decodes must fit the GPU;
ACTING programs' KV may spill to the host, bounded by GPU + host)."""

from __future__ import annotations

import math

from thunderctl.scheduler.ledger import Ledger, Load
from thunderctl.scheduler.program import Program, Worker


def headroom(worker: Worker, load: Load, band: float) -> float:
    """Room for one more decoding program under `band` (a fraction of capacity) on every level."""
    if worker.capacity is None:
        return math.inf
    return min(worker.kv_capacity * band - load.tokens, gpu_room(worker, load, band))


def gpu_room(worker: Worker, load: Load, band: float) -> float:
    """Room on the GPU for what decodes; without a host tier GPU and all are one level (`tokens`)."""
    if not worker.host_capacity or worker.capacity is None:
        return math.inf
    return worker.capacity * band - load.decoding


def gpu_binds(worker: Worker, load: Load, band: float) -> bool:
    """Whether the GPU, not all the KV, is what keeps the queue out: then dropping an ACTING
    program's KV, which sits in the host tier, admits nobody."""
    return gpu_room(worker, load, band) < worker.kv_capacity * band - load.tokens


def decode_fits(worker: Worker, ledger: Ledger, program: Program, buffer: int, band: float) -> bool:
    """Whether an admitted program (charged on `ledger` as REASONING already) may decode now:
    always without a host tier (its reservation holds its room); with one, while what decodes
    fits the GPU's `band`, or when it would decode alone there."""
    if not worker.host_capacity or worker.capacity is None:
        return True
    alone = ledger.decoding <= program.private_tokens + buffer
    return alone or ledger.load(1.0).decoding <= worker.capacity * band
