"""The reference's issue 46 in the simulator: a burst of programs at once on a cache they overflow.

    python benchmarks/sim_burst.py                      # 64 programs, one 4×H100 worker, 131,072 KV tokens
    python benchmarks/sim_burst.py --programs 64 --kv-tokens 131072 --duration 900 --out results/sim-burst.json

There (a real engine), 64 programs arriving within 13 s gave a 1,444-token program its first
answer in 0.5 s and an 8,046-token one in 404 s: shortest first, new programs behind every
returning one. Here the burst's programs start at step 0 (no aged start), spread evenly over
the first `--arrival` seconds (13), each first prompt stretched to one of `--programs` sizes
spread evenly over issue 46's 1,444 → 8,046 tokens (the synthetic programs' own start at
1.3–3k), and each arm of the same programs reports when each of the burst's programs got its
first answer: by size class (four, of equal width), and the largest class's slowest against
the median program's (issue 22's target: within 3×), and how long any program waited for
admission against the median program.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from thunderctl.bench.report import fmt
from thunderctl.bench.swe_lite import SHARED_PREFIX_TOKENS
from thunderctl.bench.workloads import WorkloadChoice
from thunderctl.sim.arms import ArmName, SimSpec, run_arm
from thunderctl.sim.presets import get_preset, preset_names
from thunderctl.sim.waits import first_answers, program_fairness, waits_by_class
from thunderctl.traceformat import TraceProgram

ISSUE_46_FIRST_PROMPTS = (1_444, 8_046)  # tokens: the first answered in 0.5 s, the last in 404 s

ARMS = (ArmName.STICKY, ArmName.REFERENCE, ArmName.THUNDERCTL)


@dataclass(frozen=True)
class Burst:
    """The synthetic programs, the burst's first prompts stretched over issue 46's range (later
    programs, which start as slots free, are the generator's own)."""

    programs: int
    base: Any  # a SweLite
    stride: int = 37  # coprime with any power of two: sizes do not follow the program's index
    arrival_s: float = 0.0  # the burst arrives evenly over this long, in index order

    @property
    def system_prompt_tokens(self) -> int:
        return self.base.system_prompt_tokens

    @property
    def max_context_tokens(self) -> int | None:
        return self.base.max_context_tokens

    def first_prompt(self, index: int) -> int:
        low, high = ISSUE_46_FIRST_PROMPTS
        position = (index * self.stride) % self.programs / max(self.programs - 1, 1)
        return round(low + position * (high - low))

    def program(self, seed: int, index: int) -> TraceProgram:
        program = self.base.program(seed, index)
        if index >= self.programs:
            return program
        extra = max(self.first_prompt(index) - program.steps[0].prompt_tokens, 0)
        steps = tuple(step.model_copy(update={"prompt_tokens": step.prompt_tokens + extra}) for step in program.steps)
        # Its environment is ready when it arrives: the simulator sends the first request then.
        arrives = self.arrival_s * index / max(self.programs - 1, 1)
        return program.model_copy(update={"steps": steps, "env_prep_s": arrives})


def burst_spec(
    preset_name: str, programs: int, kv_tokens: int, duration_s: float, seed: int, arrival_s: float = 0.0
) -> SimSpec:
    preset = get_preset(preset_name)
    blocks = kv_tokens // preset.engine.block_size
    if blocks < 1:
        raise SystemExit(f"--kv-tokens {kv_tokens} is less than one block ({preset.engine.block_size} tokens)")
    preset = replace(preset, engine=replace(preset.engine, num_gpu_blocks=blocks))
    synthetic = WorkloadChoice(None, synthetic=True).load(1.0, SHARED_PREFIX_TOKENS, preset.engine.max_model_len)
    return SimSpec(preset, Burst(programs, synthetic, arrival_s=arrival_s), programs, duration_s, workers=1, seed=seed)


def size_classes(firsts: list[tuple[int, float]], classes: int = 4) -> list[dict[str, Any]]:
    """The first answers by the first prompt's size, in `classes` classes of equal width over
    issue 46's range: each class's programs, median and slowest first answer."""
    low, high = ISSUE_46_FIRST_PROMPTS
    width = (high - low) / classes
    rows = []
    for k in range(classes):
        lo, hi = low + k * width, low + (k + 1) * width
        seconds = [s for tokens, s in firsts if lo <= tokens < hi or (k == classes - 1 and tokens == hi)]
        rows.append({
            "tokens": f"{round(lo):,}–{round(hi):,}", "programs": len(seconds),
            "median_s": statistics.median(seconds) if seconds else None, "max_s": max(seconds, default=None),
        })  # fmt: skip
    return rows


def burst_figures(spec: SimSpec, arm: ArmName) -> dict[str, Any]:
    result = run_arm(arm, spec)
    burst = [r for r in result.records if r.program_index < spec.concurrency]
    firsts = sorted(first_answers(burst))
    quarter = max(len(firsts) // 4, 1)
    small, large = [s for _, s in firsts[:quarter]], [s for _, s in firsts[-quarter:]]
    answered = [s for _, s in firsts]
    classes = size_classes(firsts)
    median = statistics.median(answered) if answered else None
    largest = classes[-1]["max_s"]
    return {
        "steps_per_min": 60.0 * len(result.records) / spec.duration_s,
        "burst_answered": len(firsts),
        "first_answer_s": {
            "median": statistics.median(answered) if answered else None,
            "max": max(answered, default=None),
            "smallest quarter, max": max(small, default=None),
            "largest quarter, max": max(large, default=None),
        },
        "first_answers": firsts,  # (first prompt tokens, seconds), smallest first
        "size_classes": classes,
        # issue 22's target: the largest programs' first answer within 3× the median program's
        "largest_over_median": largest / median if largest is not None and median else None,
        "fairness": program_fairness(burst),
        "admission_waits": waits_by_class(burst),
        **result.scheduler_counters,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="h100-tp4-32b", choices=preset_names())
    parser.add_argument("--programs", type=int, default=64)
    parser.add_argument("--kv-tokens", type=int, default=131_072, help="The worker's KV cache (tokens).")
    parser.add_argument("--duration", type=float, default=900.0, help="Simulated seconds.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arrival", type=float, default=13.0, help="The burst arrives over this many seconds.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    spec = burst_spec(args.preset, args.programs, args.kv_tokens, args.duration, args.seed, args.arrival)
    report = {arm.value: burst_figures(spec, arm) for arm in ARMS}
    table = Table(title=f"{args.programs}-program burst, {args.preset} × 1, {args.kv_tokens:,} KV tokens")
    columns = ("arm", "steps/min", "answered", "1st answer median", "max", "smallest ¼ max", "largest ¼ max",
               "longest wait", "median program's", "ratio")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "arm" else "right")
    for name, figures in report.items():
        first, fair = list(figures["first_answer_s"].values()), figures["fairness"]
        table.add_row(
            name, fmt(figures["steps_per_min"], digits=1), str(figures["burst_answered"]),
            *(fmt(value, " s", 1) for value in first),
            fmt(fair["longest_s"], " s", 1), fmt(fair["median_s"], " s", 1), fmt(fair["ratio"], "x"),
        )  # fmt: skip
    console = Console(width=160)
    console.print(table)
    classes = Table(title="first answer by first prompt, median / slowest; the largest class's slowest ÷ the median")
    classes.add_column("arm")
    for row in next(iter(report.values()))["size_classes"]:
        classes.add_column(f"{row['tokens']} tokens ({row['programs']})", justify="right")
    classes.add_column("largest ÷ median (target ≤ 3×)", justify="right")
    for name, figures in report.items():
        cells = [f"{fmt(row['median_s'], ' s', 1)} / {fmt(row['max_s'], ' s', 1)}" for row in figures["size_classes"]]
        classes.add_row(name, *cells, fmt(figures["largest_over_median"], "x"))
    console.print(classes)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"parameters": vars(args) | {"out": str(args.out)}, "arms": report}, indent=1))


if __name__ == "__main__":
    main()
