"""Measured engine steps: the table a linear step-time model is fitted to, and its CSV form."""

from __future__ import annotations

import csv
from dataclasses import dataclass, fields
from pathlib import Path

from thunderctl.sim.cost import StepLoad

CPU_TINY_STEPS_CSV = Path(__file__).with_name("data") / "cpu_tiny_steps.csv"


@dataclass(frozen=True)
class MeasuredSteps:
    """One measured load: the steps it spans, their loads summed, and what they took."""

    kind: str
    label: str
    repeats: int
    seconds: float  # median over the repeats
    seconds_min: float
    seconds_max: float
    steps: int
    scheduled_tokens: int
    attention_pairs: int
    num_seqs: int
    context_tokens: int

    @property
    def summed(self) -> StepLoad:
        return StepLoad(
            scheduled_tokens=self.scheduled_tokens,
            num_seqs=self.num_seqs,
            attention_pairs=self.attention_pairs,
            context_tokens=self.context_tokens,
        )


COLUMNS = [f.name for f in fields(MeasuredSteps)]
CONVERTERS = {"str": str, "int": int, "float": float}


def write_step_table(path: Path, rows: list[MeasuredSteps], source: str) -> None:
    """The rows as CSV, after one `#` line naming where they come from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        file.write(f"# {source}\n")
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({name: getattr(row, name) for name in COLUMNS})


def read_step_table(path: Path) -> list[MeasuredSteps]:
    with path.open(newline="") as file:
        lines = [line for line in file if not line.startswith("#")]
    types = {f.name: CONVERTERS[str(f.type)] for f in fields(MeasuredSteps)}
    rows = []
    for number, record in enumerate(csv.DictReader(lines), start=2):
        if set(record) != set(COLUMNS):
            raise ValueError(f"{path}: row {number} has columns {sorted(record)}, expected {COLUMNS}")
        rows.append(MeasuredSteps(**{name: types[name](value) for name, value in record.items()}))
    return rows
