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
    # Hosts the pool created containers on (written before the first is made): where `down`
    # must reach Docker before it forgets the cluster, with or without the profile.
    used_hosts: list[str] = Field(default_factory=list)

    def hosts_to_sweep(self) -> list[str]:
        """Every host that may hold a container of the cluster: those it made some on, those of its adoptions."""
        return list(dict.fromkeys([*self.used_hosts, *(a.host for a in self.adopted)]))

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
