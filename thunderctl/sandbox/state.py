"""What the pool must remember across a daemon crash that Docker labels cannot tell it: the
sandboxes bound to programs (a warm sandbox's labels name no program, an adopted container carries
no labels of ours) and images it pulled (so it may evict them later)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

log = logging.getLogger(__name__)


class BoundContainer(BaseModel):
    """The container of a ready sandbox bound to a program: enough to bind it again in the next
    daemon (if the program lives on there) or to know what to collect (if it does not)."""

    host: str
    container_id: str
    # None in records written before sandboxes were bound again: their program is unknown.
    lease: str | None = None  # the sandbox's id
    program_id: str | None = None
    image: str = ""
    env: dict[str, str] = Field(default_factory=dict)  # given to every exec


class PoolState(BaseModel):
    # Written when the sandbox is bound and ready; forgotten at its release (an adopted one once
    # its container is gone).
    adopted: list[BoundContainer] = Field(default_factory=list)  # started by agents: only this names them
    made: list[BoundContainer] = Field(default_factory=list)  # the pool's own: their labels name them too
    pulled: dict[str, dict[str, float]] = Field(default_factory=dict)  # host -> image -> last used
    # Hosts the pool created containers on (written before the first is made): where `down`
    # must reach Docker before it forgets the cluster, with or without the profile.
    used_hosts: list[str] = Field(default_factory=list)

    def forget(self, sandbox_container: str, adopted: bool) -> bool:
        """Drop the record of this container; whether there was one."""
        records = self.adopted if adopted else self.made
        kept = [r for r in records if r.container_id != sandbox_container]
        if adopted:
            self.adopted = kept
        else:
            self.made = kept
        return len(kept) < len(records)

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
