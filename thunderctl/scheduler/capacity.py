"""A backend's room: one level of KV, or two with a host tier (what decodes must fit the GPU;
ACTING programs' KV may spill to the host, bounded by GPU + host)."""

from __future__ import annotations

import math

from thunderctl.scheduler.ledger import Ledger, Load
from thunderctl.scheduler.program import Backend, Program


def headroom(backend: Backend, load: Load, band: float) -> float:
    """Room for one more decoding program under `band` (a fraction of capacity) on every level."""
    if backend.capacity is None:
        return math.inf
    return min(backend.kv_capacity * band - load.tokens, gpu_room(backend, load, band))


def gpu_room(backend: Backend, load: Load, band: float) -> float:
    """Room on the GPU for what decodes; without a host tier GPU and all are one level (`tokens`)."""
    if not backend.host_capacity or backend.capacity is None:
        return math.inf
    return backend.capacity * band - load.decoding


def gpu_binds(backend: Backend, load: Load, band: float) -> bool:
    """Whether the GPU, not all the KV, is what keeps the queue out: then dropping an ACTING
    program's KV, which sits in the host tier, admits nobody."""
    return gpu_room(backend, load, band) < backend.kv_capacity * band - load.tokens


def decode_fits(backend: Backend, ledger: Ledger, program: Program, buffer: int, band: float) -> bool:
    """Whether an admitted program (charged on `ledger` as REASONING already) may decode now:
    always without a host tier (its reservation holds its room); with one, while what decodes
    fits the GPU's `band`, or when it would decode alone there."""
    if not backend.host_capacity or backend.capacity is None:
        return True
    alone = ledger.decoding <= program.private_tokens + buffer
    return alone or ledger.load(1.0).decoding <= backend.capacity * band
