"""Program-aware scheduling: the pure policy and the state it keeps."""

from thunderctl.scheduler.config import Decay, PauseOrder, PlacementRule, Policy, SchedulerConfig
from thunderctl.scheduler.events import EventKind, ProgramEvent
from thunderctl.scheduler.policy import Scheduler
from thunderctl.scheduler.program import Phase, Program, Status, Worker

__all__ = [
    "Worker",
    "Decay",
    "PauseOrder",
    "PlacementRule",
    "Policy",
    "EventKind",
    "Phase",
    "Program",
    "ProgramEvent",
    "Scheduler",
    "SchedulerConfig",
    "Status",
]
