"""Record live traffic as a trace: one JSONL line per program when it ends.

The lines follow docs/trace-format.md (what `thunderctl bench swe-lite --trace` replays): per
answered request the engine's prompt and completion tokens, and the time from that answer to
the program's next request (its tool time). The gateway calls three hooks; a program's line
is written when it is released or expires, and programs still open are written at close.
The lines are thunderctl.traceformat's programs, the module the replayer reads them with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from thunderctl.traceformat import TraceProgram, TraceStep, program_line


@dataclass
class _Open:
    steps: list[TraceStep] = field(default_factory=list)
    answered_at: float | None = None  # when the last answer came back
    asked_at: float | None = None  # when the request after it arrived


class TraceRecorder:
    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._open: dict[str, _Open] = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered: every finished program reaches the file even if the gateway is killed.
        self._file = path.open("a", encoding="utf-8", buffering=1)

    def on_request(self, program_id: str) -> None:
        """A request of the program arrived (before it is admitted: waiting while paused is
        the gateway's doing, not the agent's)."""
        program = self._open.setdefault(program_id, _Open())
        program.asked_at = self._clock()

    def on_usage(self, program_id: str, prompt_tokens: int, completion_tokens: int) -> None:
        """The engine's usage of a finished request of the program."""
        if prompt_tokens < 1:
            return  # not a served step (a trace step needs a prompt)
        program = self._open.setdefault(program_id, _Open())
        now = self._clock()
        if program.steps and program.answered_at is not None and program.asked_at is not None:
            tool_s = round(max(0.0, program.asked_at - program.answered_at), 3)
            program.steps[-1] = program.steps[-1].model_copy(update={"tool_s": tool_s})
        program.steps.append(TraceStep(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))
        program.answered_at = now

    def on_end(self, program_id: str) -> None:
        """The program was released or expired; idempotent."""
        program = self._open.pop(program_id, None)
        if program is not None and program.steps:
            traced = TraceProgram(id=program_id, steps=tuple(program.steps), source="thunderctl gateway")
            self._file.write(program_line(traced) + "\n")

    def close(self) -> None:
        for program_id in list(self._open):
            self.on_end(program_id)
        self._file.close()
