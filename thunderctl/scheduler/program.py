"""The scheduler's view of an agent program and of a worker (one vLLM worker)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Phase(StrEnum):
    REASONING = "reasoning"  # a request of the program is in flight, or waiting to go
    ACTING = "acting"  # between a response and the program's next request (a tool runs)


class Status(StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    TERMINATED = "terminated"


@dataclass
class Program:
    id: str
    tokens: int = 0  # context the engine holds for it: last prompt + completion, or an estimate
    phase: Phase = Phase.REASONING
    status: Status = Status.PAUSED
    worker: str | None = None  # where it runs while ACTIVE; kept while PAUSED for reporting
    # A prefix many programs share (the system prompt) sits once in the engine's prefix cache,
    # so it is charged once per worker rather than once per program.
    prefix_key: str | None = None
    prefix_tokens: int = 0
    steps: int = 0
    created_at: float = 0.0
    last_activity: float = 0.0
    acting_since: float = 0.0
    paused_at: float | None = None
    paused_total_s: float = 0.0
    waiting_since: float | None = None  # a request arrived while PAUSED and waits for resume
    pause_at_boundary: bool = False  # REASONING and chosen to pause once its response is out
    responded_at: float | None = None  # its last response ended and no request followed yet
    tool: str | None = None  # the tool its last answer called, when the answer names one
    group: str | None = None  # the group it is a sample of (groups.py), once a request named one
    # The program it was started from (a subagent's session, a Dynamo trajectory's parent): while a
    # child runs, its parent is in a tool call that lasts the child's life.
    parent: str | None = None
    children: int = 0  # its live children

    @property
    def is_new(self) -> bool:
        return self.steps == 0

    @property
    def private_tokens(self) -> int:
        return max(self.tokens - self.prefix_tokens, 0)

    def resume(self, now: float) -> None:
        """ACTIVE from `now`, its time paused counted."""
        self.status = Status.ACTIVE
        if self.paused_at is not None:
            self.paused_total_s += now - self.paused_at
        self.paused_at, self.pause_at_boundary = None, False
        if self.phase is Phase.ACTING:
            self.acting_since = now  # its tool time so far is not evidence of idleness here

    def pause(self, now: float) -> None:
        self.status, self.paused_at, self.pause_at_boundary = Status.PAUSED, now, False


@dataclass
class Worker:
    id: str
    capacity: int | None  # KV tokens; None when the engine does not say (never paused there)
    # KV tokens of its host tier (vLLM's CPU offloading): ACTING programs' KV may spill there,
    # what decodes must still fit `capacity`.
    host_capacity: int = 0
    schedulable: bool = True  # False while draining or unhealthy: nothing new is placed there
    programs: set[str] = field(default_factory=set)  # ids of ACTIVE programs placed here

    @property
    def kv_capacity(self) -> int:
        """All the KV tokens it may hold: GPU and host tier (0 when the engine does not say)."""
        return (self.capacity or 0) + self.host_capacity
