"""What a gateway that ended left for the next to start from: its scheduler's programs and laws,
its derived programs and their conversations, its Responses chains (the daemon's journal keeps them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from thunderctl.gateway.chains import Kept
from thunderctl.gateway.identity import IndexSnapshot
from thunderctl.scheduler.snapshot import SchedulerSnapshot


@dataclass
class Restored:
    scheduler: SchedulerSnapshot
    elapsed_s: float  # since the scheduler's snapshot was taken
    derived: list[str] = field(default_factory=list)  # the live programs whose id was derived
    conversations: IndexSnapshot | None = None
    responses: list[tuple[str, Kept]] = field(default_factory=list)
