"""Cross-node KV imbalance (the paper's Fig. 2a) from a `thunderctl bench simulate` report.

    thunderctl bench simulate --workers 2 --workload mixed --concurrency 32,48,64,96,144 --duration 5400 \
        --arms sticky,thunderctl --out results/sim-mixed.json
    python benchmarks/sim_imbalance.py results/sim-mixed.json --concurrency 64   # and results/sim-mixed-imbalance.png

For every point of the report (or --concurrency N alone), per arm: the difference of the two
workers' KV occupancy over the measured time, its mean and peak, and how long it exceeds
--threshold (20 %, as the paper counts it: 37 of 90 minutes for sticky routing, peak 51 %). For
the drawn point (--concurrency, default the last), the difference over time as a table of
--bucket-minute buckets (each bucket's mean and peak) and a sparkline per arm, and the plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from thunderctl.bench.report import fmt

SPARKS = "▁▂▃▄▅▆▇█"


def differences(samples: list[list]) -> tuple[list[float], list[float]]:
    """Times and |KV occupancy of worker 0 - worker 1| of an arm's occupancy samples."""
    times = [t for t, _ in samples]
    return times, [abs(usage[0] - usage[1]) for _, usage in samples]


def minutes_above(times: list[float], diffs: list[float], threshold: float) -> tuple[float, float]:
    """Minutes the difference exceeds `threshold`, and the minutes measured (samples are evenly spaced)."""
    step_s = times[1] - times[0] if len(times) > 1 else 0.0
    return sum(d > threshold for d in diffs) * step_s / 60, len(diffs) * step_s / 60


def buckets(times: list[float], diffs: list[float], minutes: float) -> dict[int, list[float]]:
    """The differences by bucket of `minutes`, keyed by the bucket's start minute."""
    grouped: dict[int, list[float]] = {}
    for t, d in zip(times, diffs):
        start = int(t / 60 // minutes * minutes)
        grouped.setdefault(start, []).append(d)
    return grouped


def sparkline(values: list[float], width: int = 60) -> str:
    """The values as `width` characters, each the peak of its stretch on a 0-100 % scale."""
    if not values:
        return ""
    per = max(1, -(-len(values) // width))
    peaks = [max(values[i : i + per]) for i in range(0, len(values), per)]
    return "".join(SPARKS[min(len(SPARKS) - 1, int(p * len(SPARKS)))] for p in peaks)


def summary_table(report: dict[str, Any], points: list[dict[str, Any]], threshold: float) -> Table:
    table = Table(title=f"{report['preset']} × 2, workload {report['workload']['name']}: KV occupancy difference")
    for column in ("programs", "arm", "mean", "peak", f"time > {threshold:.0%}", "minutes", "steps/min"):
        table.add_column(column, justify="left" if column == "arm" else "right")
    for point in points:
        for name, arm in point["arms"].items():
            times, diffs = differences(arm["occupancy"])
            if not diffs:
                continue
            above, measured = minutes_above(times, diffs, threshold)
            table.add_row(
                str(point["concurrency"]), name, fmt(100 * sum(diffs) / len(diffs), " %", 1),
                fmt(100 * max(diffs), " %", 1), fmt(100 * above / measured, " %", 0),
                f"{above:.0f} of {measured:.0f}", fmt(arm["steps_per_min"], digits=1),
            )  # fmt: skip
    return table


def over_time_table(point: dict[str, Any], minutes: float) -> Table:
    table = Table(title=f"{point['concurrency']} programs: the difference over simulated time (bucket mean / peak)")
    table.add_column("minutes", justify="right")
    series = {name: buckets(*differences(arm["occupancy"]), minutes) for name, arm in point["arms"].items()}
    for name in series:
        table.add_column(name, justify="right")
    for start in sorted({start for grouped in series.values() for start in grouped}):
        cells = []
        for grouped in series.values():
            values = grouped.get(start, [])
            cells.append(f"{100 * sum(values) / len(values):.0f} / {100 * max(values):.0f} %" if values else "-")
        table.add_row(f"{start:g}-{start + minutes:g}", *cells)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument(
        "--concurrency", type=int, help="The only point to report and draw (default: all; draw the last)."
    )
    parser.add_argument("--threshold", type=float, default=0.2)
    parser.add_argument("--bucket", type=float, default=10.0, help="Minutes per row of the over-time table.")
    parser.add_argument("--plot", type=Path, help="Default: the report's name with -imbalance.png.")
    args = parser.parse_args()
    report = json.loads(args.report.read_text())
    if report["parameters"]["workers"] != 2:
        raise SystemExit(
            f"{args.report}: the figure compares two workers; this report has {report['parameters']['workers']}"
        )
    points = {p["concurrency"]: p for p in report["points"]}
    if args.concurrency is not None and args.concurrency not in points:
        raise SystemExit(f"{args.report} has no point at concurrency {args.concurrency}: it has {sorted(points)}")
    point = points[args.concurrency] if args.concurrency else report["points"][-1]

    console = Console(width=140)
    console.print(summary_table(report, [point] if args.concurrency else report["points"], args.threshold))
    console.print(over_time_table(point, args.bucket))
    for name, arm in point["arms"].items():
        console.print(
            f"{name:>12} {sparkline(differences(arm['occupancy'])[1])}  (0-100 %, each mark its stretch's peak)"
        )

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axis = pyplot.subplots(figsize=(8, 4))
    for name, arm in point["arms"].items():
        times, diffs = differences(arm["occupancy"])
        axis.plot([t / 60 for t in times], [100 * d for d in diffs], label=name)
    axis.axhline(100 * args.threshold, color="grey", linestyle=":", linewidth=1)
    axis.set_xlabel("simulated time (min)")
    axis.set_ylabel("|KV occupancy w0 - w1| (%)")
    axis.set_title(f"{report['preset']} × 2, {report['workload']['name']}, {point['concurrency']} programs")
    axis.legend()
    figure.tight_layout()
    plot = args.plot or args.report.with_name(f"{args.report.stem}-imbalance.png")
    figure.savefig(plot, dpi=100)
    print(f"plot: {plot}")


if __name__ == "__main__":
    main()
