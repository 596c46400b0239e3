"""Admission waits of a simulated run: by context-size class, and how evenly programs wait (issue 12's fairness)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from thunderctl.percentiles import percentile
from thunderctl.sim.agents import SimStep

# Upper bounds (prompt tokens) of the context-size classes waits are reported by; the last is open.
CONTEXT_CLASSES: tuple[tuple[str, int | None], ...] = (
    ("<=8k", 8_192),
    ("8-16k", 16_384),
    ("16-32k", 32_768),
    (">32k", None),
)


def context_class(prompt_tokens: int) -> str:
    for name, bound in CONTEXT_CLASSES:
        if bound is None or prompt_tokens <= bound:
            return name
    raise AssertionError("the last class is open")


def waits_by_class(records: Sequence[SimStep]) -> dict[str, dict[str, Any]]:
    """Per class of prompt size: requests, and their admission wait's p50, p99 and max (seconds)."""
    by_class: dict[str, list[float]] = {name: [] for name, _ in CONTEXT_CLASSES}
    for record in records:
        by_class[context_class(record.prompt_tokens)].append(record.admission_wait_s)
    return {
        name: {
            "requests": len(waits),
            "p50_s": percentile(waits, 50),
            "p99_s": percentile(waits, 99),
            "max_s": max(waits, default=None),
        }
        for name, waits in by_class.items()
    }


def program_fairness(records: Sequence[SimStep]) -> dict[str, Any]:
    """Each program's longest admission wait: the longest of any program against the median program's.

    `ratio` is None when the median program never waited (nothing to compare: either nobody
    waited, or fewer than half the programs did).
    """
    longest: dict[int, float] = {}
    for record in records:
        longest[record.program_index] = max(longest.get(record.program_index, 0.0), record.admission_wait_s)
    if not longest:
        return {"programs": 0, "longest_s": None, "median_s": None, "ratio": None}
    worst, median = max(longest.values()), statistics.median(longest.values())
    return {
        "programs": len(longest),
        "longest_s": worst,
        "median_s": median,
        "ratio": worst / median if median else None,
    }


def first_answers(records: Sequence[SimStep], first_step: int = 0) -> list[tuple[int, float]]:
    """(prompt tokens, seconds from send to answer) of each program's step `first_step`, in program order."""
    firsts = sorted((r for r in records if r.step == first_step), key=lambda r: r.program_index)
    return [(r.prompt_tokens, r.latency_s) for r in firsts]
