"""Admission waits of a simulated run, split by context size and compared across programs."""

from __future__ import annotations

import pytest

from thunderctl.sim.agents import SimStep
from thunderctl.sim.waits import context_class, program_fairness, waits_by_class


def record(program: int, sent: float, admitted: float, prompt: int = 1_000) -> SimStep:
    return SimStep(program, 0, sent, admitted + 1.0, "w0", admitted, prompt)


@pytest.mark.parametrize(("tokens", "name"), [(8_192, "<=8k"), (8_193, "8-16k"), (32_768, "16-32k"), (90_000, ">32k")])
def test_context_classes_are_bounded_by_prompt_tokens(tokens: int, name: str) -> None:
    assert context_class(tokens) == name


def test_waits_are_split_by_class_and_fairness_compares_programs_longest_waits() -> None:
    records = [record(0, 0, 10), record(0, 20, 20), record(1, 0, 4, 10_000), record(2, 0, 2), record(3, 0, 0)]
    by_class = waits_by_class(records)
    assert by_class["<=8k"]["requests"] == 4 and by_class["<=8k"]["max_s"] == 10
    assert by_class["8-16k"] == {"requests": 1, "p50_s": 4, "p99_s": 4, "max_s": 4}
    assert by_class[">32k"]["max_s"] is None
    # longest waits per program: 10, 4, 2, 0 -> median 3
    assert program_fairness(records) == {"programs": 4, "longest_s": 10, "median_s": 3, "ratio": 10 / 3}


def test_nobody_waiting_gives_no_ratio() -> None:
    assert program_fairness([record(0, 0, 0), record(1, 5, 5)])["ratio"] is None
