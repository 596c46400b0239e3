"""How long to wait before starting again a process that keeps dying: at once, then ever longer."""

from __future__ import annotations

# Past this many doublings every wait is the cap anyway; bounding the exponent keeps a streak of
# restarts days long from overflowing a float.
_MAX_DOUBLINGS = 62


def backoff_s(restart: int, initial_s: float, max_s: float) -> float:
    """The wait before restart number `restart` since the process last ran well (0 is the first):
    none for the first, `initial_s` for the second, doubling after each, never more than `max_s`."""
    if restart == 0:
        return 0.0
    return min(initial_s * 2.0 ** min(restart - 1, _MAX_DOUBLINGS), max_s)
