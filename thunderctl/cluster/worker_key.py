"""The cluster's worker key: made by `up`, kept owner-only in the state directory, and sent by
everything that talks to a worker (the daemon's gateway, health polls, the bench's direct arm)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

WORKER_KEY_FILE = "worker.key"


def worker_key_path(state_dir: Path) -> Path:
    return state_dir / WORKER_KEY_FILE


def create_worker_key(state_dir: Path) -> str:
    """A new random key, written mode 0600 before any byte of it reaches the disk."""
    key = secrets.token_urlsafe(32)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = worker_key_path(state_dir)
    path.unlink(missing_ok=True)  # O_CREAT keeps the mode of a file that is already there
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(key)
    return key


def read_worker_key(state_dir: Path) -> str | None:
    """The cluster's key; None for a cluster started before workers had keys."""
    try:
        return worker_key_path(state_dir).read_text().strip() or None
    except FileNotFoundError:
        return None
