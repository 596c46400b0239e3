"""The end of a process's log file: usually the error that ended it."""

from __future__ import annotations

from collections import deque
from pathlib import Path


def tail_of_file(path: Path, lines: int) -> str:
    try:
        with path.open("r", errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except FileNotFoundError:
        return f"(no log at {path})"
