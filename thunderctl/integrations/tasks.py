"""A batch's tasks (SWE-bench-style records in JSONL, JSON or YAML, checked record by record) and
its results."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError


class TaskFileError(ValueError):
    """A task file that cannot be used; the message names the file, the record and the field."""


class AgentTask(BaseModel):
    """One task of a batch. SWE-bench's instance fields are taken as they are (`instance_id`,
    `image_name` / `docker_image`); fields the batch does not use are ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    # Part of program ids and of trajectory file names, hence the restricted alphabet.
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", validation_alias=AliasChoices("id", "instance_id"))
    problem_statement: str = Field(min_length=1)
    image: str | None = Field(None, validation_alias=AliasChoices("image", "image_name", "docker_image"))


def read_records(path: Path) -> list[tuple[str, object]]:
    """The file's records, each with where it is (`tasks.jsonl:3`, `tasks.yaml[2]`)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise TaskFileError(
                    f"{path}:{number}: not JSON ({exc.msg}); a .jsonl file has one task object per line"
                ) from exc
        return records
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise TaskFileError(f"{path}: unknown task file type {path.suffix!r}; use .jsonl, .json, .yaml or .yml")
    try:
        loaded = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise TaskFileError(f"{path}: cannot be parsed: {exc}") from exc
    if not isinstance(loaded, list):
        raise TaskFileError(f"{path}: must hold a list of tasks, found {type(loaded).__name__}")
    return [(f"{path}[{index}]", record) for index, record in enumerate(loaded)]


def load_tasks(path: Path) -> list[AgentTask]:
    """The tasks of a file, or TaskFileError naming the first bad record and field."""
    tasks: list[AgentTask] = []
    seen: dict[str, str] = {}
    for where, record in read_records(path):
        try:
            task = AgentTask.model_validate(record)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'task'}: {e['msg']}" for e in exc.errors())
            raise TaskFileError(f"{where}: {problems}") from exc
        if task.id in seen:
            raise TaskFileError(f"{where}: id {task.id!r} is already the id of {seen[task.id]}; ids must be unique")
        seen[task.id] = where
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: holds no task")
    return tasks


@dataclass
class AgentResult:
    """How one agent run ended, with the steps the agent made and those the gateway tracked."""

    task_id: str
    program_id: str
    exit_status: str
    submission: str
    steps: int  # LLM calls the agent made
    gateway_steps: int  # steps the gateway tracked for the program, read just before its release
    sandbox_id: str | None
    duration_s: float
    error: str = ""
