"""Variants of thunderctl's policy in the simulator, on the same programs: steps/min and whole programs.

    python benchmarks/policy_variants.py --variant default='{}' \\
        --variant law='{"waits.nearest_end_s": 300}' --workload long-tail --concurrency 64,128,256 --out results/variants.json
    python benchmarks/policy_variants.py --rollout 16x8 --arms sticky,reference \\
        --variant default='{}' --variant no-retention='{"retention.enabled": false}' --seed 2

With `--rollout TASKSxSAMPLES` each run is one RL batch (tasks × samples a task, measured whole,
from its start, for at most `--duration`, default 6 h) and reports its makespan, the last group's
end ÷ the median group's, the makespan ÷ the critical path (the longest program alone) and the
cache hit rate, instead of steps/min at each concurrency.

Each variant is the thunderctl arm with some SchedulerConfig fields overridden (JSON); the
named arms (`--arms`, e.g. sticky,reference) run beside them as baselines. One process, runs one
after the other: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from thunderctl.bench.report import fmt
from thunderctl.bench.simulate import WorkloadName, build_workload
from thunderctl.sim.arms import ArmName, SimSpec, run_arm
from thunderctl.sim.presets import get_preset, preset_names
from thunderctl.sim.rollout import BATCH_MAX_S, Rollout, critical_figures, critical_path

FIGURES = ("steps_per_min", "program_p50_s", "program_p90_s", "program_p99_s", "programs_per_min", "p99_s")
BATCH_FIGURES = ("makespan_s", "group_last_to_median", "makespan_to_critical_path", "hit_rate")
DIGITS = {"makespan_s": 0, "group_last_to_median": 3, "makespan_to_critical_path": 3, "hit_rate": 3}


def variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, overrides = text.partition("=")
    try:
        parsed = json.loads(overrides or "{}")
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--variant {name}: {exc}; give NAME='{{\"field\": value}}'") from exc
    return name, parsed


def rollout(text: str) -> Rollout:
    try:
        return Rollout.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="h100-tp4-32b", choices=preset_names())
    parser.add_argument("--workload", default=WorkloadName.LONG_TAIL.value, choices=[w.value for w in WorkloadName])
    parser.add_argument("--concurrency", default="64,128,256")
    parser.add_argument("--duration", type=float, help="Simulated seconds a point (default 900; 6 h a batch).")
    parser.add_argument("--rollout", type=rollout, help="One RL batch of TASKSxSAMPLES instead of --concurrency.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default="reference", help="Baseline arms, comma-separated (may be empty).")
    parser.add_argument("--variant", type=variant, action="append", default=[], help="NAME=JSON overrides.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    preset = get_preset(args.preset)
    workload = build_workload(WorkloadName(args.workload), None, 1.0, None, preset.engine.max_model_len)
    variants = args.variant or [("thunderctl", {})]
    baselines = [ArmName(a) for a in args.arms.split(",") if a]
    report: dict[str, dict[str, dict[str, Any]]] = {}
    console = Console(width=160)
    batch: Rollout | None = args.rollout
    figures_shown = BATCH_FIGURES if batch else FIGURES
    # The same programs in every run: one critical path (the longest program alone) for all.
    path_s = critical_path(workload, args.seed, batch, preset).seconds if batch else None
    duration_s = args.duration or (BATCH_MAX_S if batch else 900.0)
    for concurrency in [batch.programs] if batch else [int(c) for c in args.concurrency.split(",")]:
        spec = SimSpec(
            preset, workload, concurrency, duration_s, workers=args.workers, seed=args.seed, rollout=batch,
            warmup_s=0.0 if batch else duration_s / 6,
        )  # fmt: skip
        runs = [(arm.value, arm, {}) for arm in baselines] + [(n, ArmName.THUNDERCTL, o) for n, o in variants]
        point = report.setdefault(str(concurrency), {})
        for name, arm, overrides in runs:
            started = time.process_time()
            summary = run_arm(arm, SimSpec(**{**vars(spec), "policy": overrides})).summary(spec.warmup_s)
            if batch:
                summary.update(critical_figures(summary["makespan_s"], path_s))
            point[name] = {f: summary[f] for f in figures_shown} | {
                "bound_pauses": summary.get("bound_pauses"), "cpu_s": time.process_time() - started,
            }  # fmt: skip
        what = f"rollout {batch}" if batch else f"{concurrency} programs"
        table = Table(title=f"{args.preset} × {args.workers}, {args.workload}, {what}, seed {args.seed}")
        for column in ("variant", *figures_shown, "bound pauses"):
            table.add_column(column, justify="left" if column == "variant" else "right")
        for name, figures in point.items():
            cells = [fmt(figures[f], digits=DIGITS.get(f, 1)) for f in figures_shown]
            table.add_row(name, *cells, str(figures["bound_pauses"] or ""))
        console.print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"parameters": {**vars(args), "out": str(args.out), "rollout": batch and str(batch)}, "points": report},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
