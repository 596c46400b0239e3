"""A cluster-wide pause for a weight update: its mode, its bound, and whether it has outlived it.

Pure and synchronous with the time passed in, like the policy: the gateway (gateway/admin.py)
holds requests and calls the engines; this says what state the pause is in.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class PauseMode(StrEnum):
    """What the engines do with the requests they are running (vLLM's `POST /pause?mode=`)."""

    KEEP = "keep"  # frozen where they are; they go on after the resume
    WAIT = "wait"  # they finish; the pause is in place once the engines are idle
    ABORT = "abort"  # aborted at once; their clients get an aborted answer


class AdminConfig(BaseModel):
    """A profile's `admin:` section (and `serve --admin KEY=VALUE`)."""

    model_config = ConfigDict(extra="forbid")

    max_pause_s: float = Field(
        600.0,
        gt=0,
        description="a pause (POST /admin/pause) nobody resumes ends by itself after this long: "
        "a crashed trainer must not freeze the cluster",
    )


class PauseEnd(StrEnum):
    RESUMED = "resumed"  # POST /admin/resume
    TIMED_OUT = "timed out"  # max_pause_s passed
    FAILED = "failed"  # a worker refused the pause: the others were resumed at once


@dataclass
class ClusterPause:
    """The cluster's pause state: paused since when and how, or how the last pause ended."""

    max_pause_s: float
    mode: PauseMode | None = None  # None: not paused
    since_s: float | None = None
    last_end: PauseEnd | None = None
    last_duration_s: float | None = None
    pauses: int = 0
    timeouts: int = 0

    @property
    def paused(self) -> bool:
        return self.mode is not None

    def begin(self, mode: PauseMode, now_s: float) -> bool:
        """Pause now; False if a pause is on already (its mode and clock stay)."""
        if self.paused:
            return False
        self.mode, self.since_s = mode, now_s
        self.pauses += 1
        return True

    def end(self, now_s: float, how: PauseEnd) -> bool:
        """End the pause; False if none was on."""
        if self.since_s is None:
            return False
        self.last_end, self.last_duration_s = how, now_s - self.since_s
        self.timeouts += how is PauseEnd.TIMED_OUT
        self.mode, self.since_s = None, None
        return True

    def left_s(self, now_s: float) -> float:
        """Seconds until the pause outlives its bound (0 once it has; the bound when not paused)."""
        if self.since_s is None:
            return self.max_pause_s
        return max(self.since_s + self.max_pause_s - now_s, 0.0)

    def overdue(self, now_s: float) -> bool:
        return self.paused and self.left_s(now_s) == 0.0

    def view(self, now_s: float) -> dict[str, object]:
        """As `status` and `GET /admin/pause` show it."""
        return {
            "paused": self.paused,
            "mode": self.mode.value if self.mode else None,
            "paused_for_s": round(now_s - self.since_s, 3) if self.since_s is not None else None,
            "ends_by_itself_in_s": round(self.left_s(now_s), 3) if self.paused else None,
            "max_pause_s": self.max_pause_s,
            "pauses_total": self.pauses,
            "timed_out_total": self.timeouts,
            "last_end": self.last_end.value if self.last_end else None,
            "last_duration_s": round(self.last_duration_s, 3) if self.last_duration_s is not None else None,
        }
