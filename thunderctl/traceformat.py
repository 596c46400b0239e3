"""Agent traces, what `bench` replays and the gateway records: one program per JSONL line (docs/trace-format.md).

A step is one LLM call: the size of its whole prompt, the size of its answer, and the tool
time that followed the answer. A line may give each step's prompt as `prompt_tokens` (the
whole prompt) or as `prompt_growth` (tokens added since the previous step's prompt); reading
turns growth into whole prompts, so the rest of the code sees one form. A file whose name
ends in `.gz` is read and written gzip-compressed.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class TraceFormatError(ValueError):
    """A trace line that is not a valid program; the message names file, line and field."""


class TraceStep(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_tokens: int = Field(ge=1)
    completion_tokens: int = Field(ge=0)
    # Time between this step's answer and the next request; 0 after the last step.
    tool_s: float = Field(default=0.0, ge=0.0)


class TraceProgram(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1)
    steps: tuple[TraceStep, ...] = Field(min_length=1)
    # Time to prepare the program's environment (a sandbox) before its first step.
    env_prep_s: float | None = Field(default=None, ge=0.0)
    source: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _growth_to_prompts(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("steps"), list | tuple):
            return data
        return {**data, "steps": prompts_from_growth(data["steps"])}

    def scaled(self, factor: float) -> TraceProgram:
        """The same program with every token count times `factor` (at least one token);
        step counts and times are kept, so the shape of the program stays."""
        steps = tuple(
            TraceStep(
                prompt_tokens=max(1, round(step.prompt_tokens * factor)),
                completion_tokens=max(1, round(step.completion_tokens * factor)),
                tool_s=step.tool_s,
            )
            for step in self.steps
        )
        return self.model_copy(update={"steps": steps})

    @property
    def total_prompt_tokens(self) -> int:
        return sum(step.prompt_tokens for step in self.steps)

    @property
    def total_completion_tokens(self) -> int:
        return sum(step.completion_tokens for step in self.steps)


def prompts_from_growth(steps: list[Any] | tuple[Any, ...]) -> list[Any]:
    """Steps written with `prompt_growth` get the running total as `prompt_tokens`."""
    prompt = 0
    converted = []
    for step in steps:
        if isinstance(step, dict) and "prompt_growth" in step and "prompt_tokens" not in step:
            fields = {key: value for key, value in step.items() if key != "prompt_growth"}
            growth = step["prompt_growth"]
            # A growth that is not a number is passed on for validation to reject.
            step = {**fields, "prompt_tokens": prompt + growth if isinstance(growth, int) else growth}
        if isinstance(step, dict) and isinstance(step.get("prompt_tokens"), int):
            prompt = step["prompt_tokens"]
        converted.append(step)
    return converted


def parse_program_line(line: str, where: str) -> TraceProgram:
    try:
        return TraceProgram.model_validate_json(line)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "line"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise TraceFormatError(f"{where}: {field}: {first['msg']}{more}") from None


def open_text(path: Path, mode: str) -> IO[str]:
    """`mode` "r" or "w", as UTF-8 text, through gzip when the name ends in `.gz`."""
    if path.suffix == ".gz":
        # No time stamp in the header: the same programs give the same bytes.
        return io.TextIOWrapper(gzip.GzipFile(path, f"{mode}b", mtime=0), encoding="utf-8")
    return path.open(mode, encoding="utf-8")


def iter_trace(path: Path) -> Iterator[TraceProgram]:
    with open_text(path, "r") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield parse_program_line(line, f"{path}:{number}")


def read_trace(path: Path) -> list[TraceProgram]:
    programs = list(iter_trace(path))
    if not programs:
        raise TraceFormatError(f"{path}: no programs in the trace")
    return programs


def program_line(program: TraceProgram) -> str:
    return program.model_dump_json(exclude_none=True)


def write_trace(programs: Iterable[TraceProgram], path: Path) -> int:
    """Write programs as JSONL; returns how many."""
    count = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_text(path, "w") as out:
        for program in programs:
            out.write(program_line(program) + "\n")
            count += 1
    return count
