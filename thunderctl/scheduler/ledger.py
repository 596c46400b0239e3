"""What a worker is charged: its programs' tokens, each shared prefix counted once, and the
part of it that decodes (must sit on the GPU when a host KV tier holds the rest); kept matching
the programs as they change (`recharged`)."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from thunderctl.scheduler.ordering import WaitingQueue
from thunderctl.scheduler.program import Phase, Program, Status


@dataclass
class Load:
    """Tokens charged on one worker, with each shared prefix counted once; `decoding` is the
    part of them its REASONING programs (and the shared prefixes) need on the GPU."""

    tokens: float = 0.0
    prefix_holders: Counter[str] = field(default_factory=Counter)
    decoding: float = 0.0

    def holds(self, prefix_key: str | None) -> bool:
        return prefix_key is not None and self.prefix_holders[prefix_key] > 0

    def need(self, program: Program, weight: float, buffer: int) -> float:
        return sum(self._parts(program, weight, buffer))

    def _parts(self, program: Program, weight: float, buffer: int) -> tuple[float, int]:
        """Its own tokens (+ buffer), and its prefix's unless another program here holds it."""
        shared = program.prefix_key is not None and self.prefix_holders[program.prefix_key] > 0
        return weight * program.private_tokens + buffer, 0 if shared else program.prefix_tokens

    def add(self, program: Program, weight: float, buffer: int) -> None:
        own, prefix = self._parts(program, weight, buffer)
        self.tokens += own + prefix
        self.decoding += prefix + (own if program.phase is Phase.REASONING else 0)
        if program.prefix_key is not None:
            self.prefix_holders[program.prefix_key] += 1

    def remove(self, program: Program, weight: float, buffer: int) -> None:
        if program.prefix_key is not None:
            self.prefix_holders[program.prefix_key] -= 1
        own, prefix = self._parts(program, weight, buffer)
        self.tokens -= own + prefix
        self.decoding -= prefix + (own if program.phase is Phase.REASONING else 0)


@dataclass
class Ledger:
    """A worker's charges, kept up to date as programs come, go and change, so that a
    resume pass costs O(workers) rather than O(programs)."""

    private: int = 0  # Σ private tokens + buffer over its programs
    acting_private: int = 0  # Σ private tokens of its ACTING programs
    decoding: int = 0  # Σ private tokens + buffer of its REASONING programs
    holders: Counter[str] = field(default_factory=Counter)
    prefix_tokens: dict[str, int] = field(default_factory=dict)
    # Its ACTING programs as (last heard from, id), least recently first. The time is the one when it
    # was charged here, never later than its last activity now: a walk that stops at the first one
    # heard from too recently misses none heard from earlier.
    heard: list[tuple[float, str]] = field(default_factory=list)
    _heard_at: dict[str, float] = field(default_factory=dict)

    def add(self, program: Program, buffer: int) -> None:
        self.private += program.private_tokens + buffer
        if program.phase is Phase.ACTING:
            self.acting_private += program.private_tokens
            self._heard_at[program.id] = program.last_activity
            bisect.insort(self.heard, (program.last_activity, program.id))
        else:
            self.decoding += program.private_tokens + buffer
        if program.prefix_key is not None:
            self.prefix_tokens.setdefault(program.prefix_key, program.prefix_tokens)
            self.holders[program.prefix_key] += 1

    def remove(self, program: Program, buffer: int) -> None:
        self.private -= program.private_tokens + buffer
        if program.phase is Phase.ACTING:
            self.acting_private -= program.private_tokens
            entry = (self._heard_at.pop(program.id), program.id)
            del self.heard[bisect.bisect_left(self.heard, entry)]
        else:
            self.decoding -= program.private_tokens + buffer
        key = program.prefix_key
        if key is not None:
            self.holders[key] -= 1
            if self.holders[key] <= 0:
                del self.holders[key], self.prefix_tokens[key]

    def heard_before(self, since: float) -> list[str]:
        """Its ACTING programs not heard from since `since` (and maybe a few since: see `heard`)."""
        return [program_id for _, program_id in self.heard[: bisect.bisect_left(self.heard, (since, ""))]]

    def load(self, acting_weight: float) -> Load:
        tokens = self.private - (1.0 - acting_weight) * self.acting_private
        prefixes = sum(self.prefix_tokens.values())
        return Load(tokens + prefixes, Counter(self.holders), self.decoding + prefixes)


@contextmanager
def recharged(program: Program, ledgers: dict[str, Ledger], waiting: WaitingQueue, buffer: int) -> Iterator[None]:
    """Around a change of a program's size or phase: its worker's ledger is debited
    before and credited after, and a waiting program takes its place in the queue
    again, so ledgers and queue always match the programs."""
    ledger = None
    if program.status is Status.ACTIVE and program.worker is not None:
        ledger = ledgers.get(program.worker)
    if ledger is not None:
        ledger.remove(program, buffer)
    waiting_since = program.waiting_since
    waiting.remove(program)
    try:
        yield
    finally:
        if ledger is not None:
            ledger.add(program, buffer)
        if waiting_since is not None:
            waiting.add(program, waiting_since)
