"""What the scheduler tells the outside world: program events, their listeners, its counters."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from thunderctl.scheduler.program import Program

log = logging.getLogger(__name__)


class EventKind(StrEnum):
    CREATED = "created"
    PAUSED = "paused"
    RESUMED = "resumed"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass(frozen=True)
class ProgramEvent:
    kind: EventKind
    program: Program
    forced: bool = False


Listener = Callable[[ProgramEvent], None]


def notify(listeners: Iterable[Listener], event: ProgramEvent) -> None:
    """Every listener told of the event; one's failure (a sandbox host down) must not stall scheduling."""
    for listener in listeners:
        try:
            listener(event)
        except Exception:
            log.exception("listener failed on %s of %s", event.kind, event.program.id)


@dataclass
class Counters:
    pauses: int = 0
    resumes: int = 0
    forced_resumes: int = 0
    released: int = 0
    expired: int = 0
    tick_failures: int = 0
    steps: int = 0  # responses with usage: the throughput the admission law seeks
    priced_pauses: int = 0  # ACTING programs paused because their KV cost more to keep than to drop
    bound_pauses: int = 0  # ACTING programs paused to make room for a program at its wait bound
    ended_pauses: int = 0  # ACTING programs paused while others waited: silent so long they have likely ended
    gpu_waits: int = 0  # requests of admitted programs held back: their decode would not fit the GPU
    cache_resets: int = 0  # weight updates after which no program's context was cached any more
