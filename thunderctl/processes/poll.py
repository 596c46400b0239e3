"""Waiting for a condition by looking again and again, up to a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def poll_until(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    """True as soon as `condition()` holds; False if it still does not at `timeout_s`.

    It is looked at once at least, and once more at the deadline, so a short timeout
    still gives a condition that is about to hold its chance.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval_s, remaining))
    return True
