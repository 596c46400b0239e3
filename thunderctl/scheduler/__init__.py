"""Program-aware scheduling: the pure policy and the state it keeps."""

from thunderctl.scheduler.policy import (
    Decay,
    EventKind,
    ProgramEvent,
    Scheduler,
    SchedulerConfig,
)
from thunderctl.scheduler.program import Backend, Phase, Program, Status

__all__ = [
    "Backend",
    "Decay",
    "EventKind",
    "Phase",
    "Program",
    "ProgramEvent",
    "Scheduler",
    "SchedulerConfig",
    "Status",
]
