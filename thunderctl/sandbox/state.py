"""What the pool must remember across a daemon crash that Docker labels cannot tell it: containers
it adopted (they carry no labels of ours) and images it pulled (so it may evict them later)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

log = logging.getLogger(__name__)


class AdoptedContainer(BaseModel):
    host: str
    container_id: str


class PoolState(BaseModel):
    adopted: list[AdoptedContainer] = Field(default_factory=list)
    pulled: dict[str, dict[str, float]] = Field(default_factory=dict)  # host -> image -> last used

    @classmethod
    def load(cls, path: Path | None) -> PoolState:
        if path is None or not path.exists():
            return cls()
        try:
            return cls.model_validate_json(path.read_text())
        except ValidationError as exc:
            # The daemon must start all the same; the reaper still finds every labelled container.
            log.warning("ignoring unreadable sandbox state %s: %s", path, exc)
            return cls()

    def save(self, path: Path | None) -> None:
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(self.model_dump(), indent=1))
        os.replace(temporary, path)  # a crash mid-write leaves the previous state whole
